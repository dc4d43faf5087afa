"""Bad input is refused with a ValueError naming the field; broken checkpoints name the file."""
import json
import shutil
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.weights import CheckpointError
from tokenmill.textgen.sampling import SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_dense: Path):
    return make_engine(tiny_dense, num_kv_blocks=64)


def test_empty_prompt(engine) -> None:
    with pytest.raises(ValueError, match="prompt"):
        engine.add_request("a", [], SamplingParams())


def test_prompt_longer_than_the_context(engine) -> None:
    with pytest.raises(ValueError, match="prompt.*context length"):
        engine.add_request("a", [5] * (engine.max_model_len + 1), SamplingParams())


def test_token_ids_outside_the_vocabulary(engine) -> None:
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.add_request("a", [5, 10**9], SamplingParams())


def test_duplicate_request_id(engine) -> None:
    engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="request_id"):
        engine.add_request("dup", [5, 6], SamplingParams(max_tokens=2))
    engine.abort("dup")


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_p": "x"}, "top_p"),
    ({"max_tokens": -1}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 2.5}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"stop": 42}, "stop"), ({"stop": ["ok", 3]}, "stop"),
    ({"stop": {"a": 1}}, "stop"), ({"top_k": -2}, "top_k"), ({"logprobs": 99}, "logprobs"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "abc"}, "seed"),
])
def test_bad_sampling_values_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_architecture_lists_the_supported_ones(tmp_path: Path, tiny_dense: Path) -> None:
    shutil.copytree(tiny_dense, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3MoeForCausalLM"):
        LLMEngine(EngineConfig(model=str(tmp_path / "m")))


def test_missing_safetensors_names_the_file(tmp_path: Path, tiny_dense: Path) -> None:
    shutil.copytree(tiny_dense, tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        LLMEngine(EngineConfig(model=str(tmp_path / "m")))


@pytest.mark.parametrize("damage", ["truncate", "garbage_header"])
def test_corrupt_safetensors_names_the_file(tmp_path: Path, tiny_dense: Path, damage: str) -> None:
    shutil.copytree(tiny_dense, tmp_path / "m")
    path = tmp_path / "m" / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\xff" * 8 + data[8:])
    with pytest.raises(CheckpointError, match=str(path)):
        LLMEngine(EngineConfig(model=str(tmp_path / "m")))


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path, tiny_dense: Path) -> None:
    from tokenmill.engine.make_model import write_model
    sharded = write_model("tiny-dense", tmp_path / "sharded", seed=0, max_shard_mb=1)
    assert (sharded / "model.safetensors.index.json").is_file()
    prompt = [5, 6, 7, 8, 9, 10]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert make_engine(sharded).generate([prompt], params) == make_engine(tiny_dense).generate([prompt], params)
