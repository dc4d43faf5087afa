import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.runtime import protocol as p
from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import SamplingParams, TokenLogprob


def test_generate_round_trips_and_revalidates_params() -> None:
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["x"], logprobs=2)
    msg = p.unpack(p.pack(p.generate_message("r1", [1, 2, 3], params, "salt", 4, 2.5)))
    assert msg["type"] == p.GENERATE and msg["prompt_token_ids"] == [1, 2, 3] and msg["output_offset"] == 4
    assert p.params_from_wire(msg["params"]) == params
    bad = dict(msg["params"], top_p=3.0)
    with pytest.raises(ValueError, match="top_p"):
        p.params_from_wire(bad)
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        p.params_from_wire(dict(msg["params"], evil=1))


def test_tokens_frame_round_trips() -> None:
    out = RequestOutput("r", [5, 6], "hi", True, "stop", 10, 2, 4, [TokenLogprob(5, -0.1, [(5, -0.1), (9, -2.0)])], "x",
                        step_seconds=0.125)
    assert p.output_from_wire(p.unpack(p.pack(p.tokens_message(out)))) == out


@settings(max_examples=500)
@given(st.binary(max_size=64))
def test_garbage_frames_raise_protocol_error_not_crash(data: bytes) -> None:
    try:
        msg = p.unpack(data)
    except p.ProtocolError:
        return
    assert isinstance(msg, dict) and isinstance(msg["type"], str)


def test_a_map_with_an_unhashable_key_is_a_protocol_error() -> None:
    with pytest.raises(p.ProtocolError):
        p.unpack(b"\x81\x90\x00")  # {[]: 0}


def test_pickle_is_never_accepted() -> None:
    import pickle
    with pytest.raises(p.ProtocolError):
        p.unpack(pickle.dumps({"type": "generate"}))
    with pytest.raises(p.ProtocolError):
        p.unpack(msgpack.packb([1, 2]))
    with pytest.raises(p.ProtocolError):
        p.output_from_wire({"type": "tokens", "request_id": "r"})
