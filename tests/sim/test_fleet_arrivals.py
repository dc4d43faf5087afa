"""Fleet-simulator arrivals: traces and synthetic load → TraceRequests (sim.fleet.arrivals)."""
from __future__ import annotations

import ast
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tokenmill import datasets
from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
from tokenmill.kv.hashing import block_hashes, chain_hash
from tokenmill.sim.fleet import arrivals, block_chains
from tokenmill.sim.fleet.arrivals import TraceRequest, load_trace
from tokenmill.sim.fleet.synthetic import synthetic
from tokenmill.workloads.prompt_synth import HashBlockSynth, TokenSpace

MOONCAKE = datasets.data_file(datasets.MOONCAKE_TRACE)
AZURE_CONV = datasets.data_file(datasets.AZURE_CONV_TRACE)
AZURE_CODE = datasets.data_file(datasets.AZURE_CODE_TRACE)


def _shared_leading(a: list[int] | tuple[int, ...], b: list[int] | tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _live_hashes(path: Path, tpb: int, block_size: int, fit: TraceFit) -> list:
    """What the live system hashes: bench's token ids for the records, through kv.hashing."""
    records = read_trace(path, fit.max_requests)
    specs = trace_requests(records, HashBlockSynth(TokenSpace(), tpb, seed=7), fit)
    return specs, [block_hashes(spec.prompt, block_size) for spec in specs]


def _assert_same_structure(live: list[list[int]], sim: list[TraceRequest]) -> None:
    """Equal shared-prefix counts for every pair, and equal hash ⇔ equal hash across the two."""
    assert [len(h) for h in live] == [len(r.block_hashes) for r in sim]
    for i in range(len(sim)):
        for j in range(i):
            want = _shared_leading(live[i], live[j])
            assert _shared_leading(sim[i].block_hashes, sim[j].block_hashes) == want, (i, j)
    pairs = {(a, b) for lh, r in zip(live, sim) for a, b in zip(lh, r.block_hashes)}
    assert len({a for a, _ in pairs}) == len({b for _, b in pairs}) == len(pairs)


def _assert_same_requests(specs: list, sim: list[TraceRequest]) -> None:
    assert [r.request_id for r in sim] == [f"r{i}" for i in range(len(sim))]
    assert [len(s.prompt) for s in specs] == [r.input_tokens for r in sim]
    assert [s.output_len for s in specs] == [r.output_tokens for r in sim]
    assert [s.arrival_s for s in specs] == pytest.approx([r.arrival_s for r in sim])


# --- hashing -----------------------------------------------------------------------------------


def test_vectorised_xxh3_is_bit_exact_with_xxhash():
    rng = np.random.default_rng(1)
    a, b, seed = (rng.integers(0, 2**64, 2000, dtype=np.uint64) for _ in range(3))
    got = block_chains.xxh3_pair(a, b, seed).tolist()
    unseeded = block_chains.xxh3_pair(a, b).tolist()
    for x, y, s, g, u in zip(a.tolist(), b.tolist(), seed.tolist(), got, unseeded):
        data = struct.pack("<QQ", x, y)
        assert g == xxhash.xxh3_64_intdigest(data, seed=s)
        assert u == xxhash.xxh3_64_intdigest(data) == chain_hash(x, y)


def _write_jsonl(tmp_path: Path, records: list[dict], name: str = "trace.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_mooncake_hashes_are_chain_hash_of_hash_id_sub_blocks(tmp_path):
    path = _write_jsonl(tmp_path, [{"timestamp": 0, "input_length": 1024 + 100, "output_length": 3,
                                    "hash_ids": [7, 9, 11]}])
    (req,) = load_trace(path, block_size=16, tokens_per_hash_block=32)
    assert req.input_tokens == round(1124 * 32 / 512) == 70
    locals_ = [xxhash.xxh3_64_intdigest(struct.pack("<QQ", k, j)) for k in (7, 9, 11) for j in (0, 1)]
    want = [locals_[0]]
    for local in locals_[1:4]:  # 70 tokens: 4 full blocks of 16
        want.append(chain_hash(want[-1], local))
    assert req.block_hashes == tuple(want)


def test_unshared_chains_are_chain_hash_of_request_unique_locals():
    reqs = synthetic("poisson", rate=1.0, num_requests=3, input_tokens=50, output_tokens=5)
    for index, req in enumerate(reqs):
        pad = 2**64 - 1 - index
        want = [xxhash.xxh3_64_intdigest(struct.pack("<QQ", pad, 0))]
        for i in (1, 2):
            want.append(chain_hash(want[-1], xxhash.xxh3_64_intdigest(struct.pack("<QQ", pad, i))))
        assert req.block_hashes == tuple(want)


# --- agreement with the live system --------------------------------------------------------------


@pytest.mark.parametrize("tpb", [16, 32])
def test_mooncake_block_structure_matches_the_live_system(tpb):
    fit = TraceFit(max_requests=200)
    specs, live = _live_hashes(MOONCAKE, tpb, 16, fit)
    sim = load_trace(MOONCAKE, block_size=16, tokens_per_hash_block=tpb, max_requests=200)
    _assert_same_requests(specs, sim)
    _assert_same_structure(live, sim)
    assert sum(_shared_leading(live[i], live[j]) > 0 for i in range(200) for j in range(i)) >= 10


def test_mooncake_structure_matches_with_caps_time_scale_and_unaligned_blocks():
    fit = TraceFit(time_scale=0.25, max_requests=120, max_input_tokens=300, max_output_tokens=20)
    specs, live = _live_hashes(MOONCAKE, 24, 16, fit)
    sim = load_trace(MOONCAKE, block_size=16, tokens_per_hash_block=24, time_scale=0.25,
                     max_requests=120, max_input_tokens=300, max_output_tokens=20)
    _assert_same_requests(specs, sim)
    _assert_same_structure(live, sim)


@pytest.mark.parametrize("tpb,block_size", [(16, 16), (32, 16), (24, 16), (40, 16), (16, 32), (48, 32)])
def test_crafted_partial_short_and_truncated_prompts_match_the_live_system(tmp_path, tpb, block_size):
    records = [
        {"timestamp": 0, "input_length": 3 * 512, "output_length": 4, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 2 * 512 + 200, "output_length": 0, "hash_ids": [1, 2, 3]},
        {"timestamp": 9, "input_length": 4 * 512, "output_length": 1, "hash_ids": [1, 2]},  # ids short
        {"timestamp": 9, "input_length": 5 * 512, "output_length": 9, "hash_ids": [1, 2, 3, 4, 5]},
        {"timestamp": 12, "input_length": 3 * 512, "output_length": 2, "hash_ids": [1, 5, 6]},
        {"timestamp": 20, "input_length": 700, "output_length": 2, "hash_ids": []},
        {"timestamp": 30, "input_length": 2 * 512, "output_length": 2, "hash_ids": [1, 2]},
    ]
    path = _write_jsonl(tmp_path, records)
    fit = TraceFit(max_input_tokens=150)
    specs, live = _live_hashes(path, tpb, block_size, fit)
    sim = load_trace(path, block_size=block_size, tokens_per_hash_block=tpb, max_input_tokens=150)
    _assert_same_requests(specs, sim)
    _assert_same_structure(live, sim)


# --- determinism and lengths -------------------------------------------------------------------


def test_same_seed_gives_the_same_list():
    for kind in ("poisson", "gamma", "day"):
        args = dict(rate=5.0, num_requests=300, input_tokens=700, output_tokens=90, input_sigma=0.6,
                    output_sigma=0.4, cv=2.0, period_s=60.0, seed=11)
        assert synthetic(kind, **args) == synthetic(kind, **args)
        assert synthetic(kind, **args) != synthetic(kind, **{**args, "seed": 12})
    scaled = dict(max_requests=300, tokens_per_hash_block=32, rate_scale=2.5, seed=3)
    assert load_trace(MOONCAKE, **scaled) == load_trace(MOONCAKE, **scaled)
    assert load_trace(MOONCAKE, **scaled) != load_trace(MOONCAKE, **{**scaled, "seed": 4})


@pytest.mark.parametrize("block_size", [3, 16, 64])
def test_block_hashes_cover_only_full_blocks(block_size):
    sources = [load_trace(MOONCAKE, block_size=block_size, tokens_per_hash_block=32, max_requests=100),
               load_trace(AZURE_CODE, block_size=block_size, max_requests=100, rate_scale=1.5),
               synthetic("gamma", rate=2.0, num_requests=100, input_tokens=300, output_tokens=10,
                         input_sigma=1.0, cv=3.0, block_size=block_size)]
    for reqs in sources:
        assert all(len(r.block_hashes) == r.input_tokens // block_size for r in reqs)
        assert all(r.input_tokens >= 1 and r.output_tokens >= 1 for r in reqs)
        assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
        assert [r.request_id for r in reqs] == [f"r{i}" for i in range(len(reqs))]


def test_lognormal_lengths_keep_their_mean():
    reqs = synthetic("poisson", rate=1.0, num_requests=20_000, input_tokens=1000, output_tokens=200,
                     input_sigma=0.8, output_sigma=0.0)
    assert np.mean([r.input_tokens for r in reqs]) == pytest.approx(1000, rel=0.03)
    assert {r.output_tokens for r in reqs} == {200}


# --- synthetic arrival processes ---------------------------------------------------------------


def test_poisson_rate_is_the_requested_rate():
    reqs = synthetic("poisson", rate=50.0, duration_s=400.0, input_tokens=16, output_tokens=1, seed=5)
    assert len(reqs) / 400.0 == pytest.approx(50.0, rel=0.03)
    assert reqs[-1].arrival_s < 400.0
    gaps = np.diff([r.arrival_s for r in reqs])
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_gaps_have_the_requested_cv(cv):
    reqs = synthetic("gamma", rate=10.0, num_requests=20_000, input_tokens=16, output_tokens=1, cv=cv)
    gaps = np.diff([r.arrival_s for r in reqs])
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(cv, rel=0.08)
    assert 1.0 / np.mean(gaps) == pytest.approx(10.0, rel=0.05)


def test_day_shape_peaks_at_half_period():
    reqs = synthetic("day", rate=20.0, duration_s=1000.0, period_s=1000.0, peak_to_trough=4.0,
                     input_tokens=16, output_tokens=1, seed=2)
    t = np.array([r.arrival_s for r in reqs])
    assert len(t) / 1000.0 == pytest.approx(20.0, rel=0.05)
    peak = np.sum((t > 450) & (t < 550))
    trough = np.sum((t < 50) | (t > 950))
    assert 3.0 < peak / trough < 5.0  # the rate ratio over ±18° of the extremes is ~3.7
    assert np.sum((t > 250) & (t < 750)) > 2 * np.sum((t < 250) | (t > 750))


# --- rate scaling ------------------------------------------------------------------------------


def test_rate_scale_three_triples_the_count_and_keeps_the_span():
    base = load_trace(AZURE_CONV, max_requests=2000)
    scaled = load_trace(AZURE_CONV, max_requests=2000, rate_scale=3)
    assert len(scaled) == 3 * len(base)
    gap = base[-1].arrival_s / (len(base) - 1)
    assert scaled[0].arrival_s == 0.0
    assert base[-1].arrival_s <= scaled[-1].arrival_s < base[-1].arrival_s + gap
    want = sorted(r.arrival_s + c * gap / 3 for c in range(3) for r in base)
    assert [r.arrival_s for r in scaled] == pytest.approx(want)


def test_fractional_rate_scale_thins_one_more_copy():
    base = load_trace(AZURE_CONV, max_requests=4000)
    scaled = load_trace(AZURE_CONV, max_requests=4000, rate_scale=2.5, seed=9)
    assert len(scaled) / len(base) == pytest.approx(2.5, abs=0.05)
    assert len(load_trace(AZURE_CONV, max_requests=4000, rate_scale=0.5)) < 0.55 * len(base)


def test_mooncake_copies_share_inside_themselves_not_across():
    one = load_trace(MOONCAKE, tokens_per_hash_block=32, max_requests=400)
    two = load_trace(MOONCAKE, tokens_per_hash_block=32, max_requests=400, rate_scale=2)
    distinct = lambda reqs: {h for r in reqs for h in r.block_hashes}  # noqa: E731
    firsts = lambda reqs: {r.block_hashes[0] for r in reqs if r.block_hashes}  # noqa: E731
    assert len(distinct(two)) == 2 * len(distinct(one))
    assert len(firsts(two)) == 2 * len(firsts(one)) < len(two)
    assert distinct(one) <= distinct(two)  # copy 0 is the unscaled trace


def test_azure_chains_are_unique_and_arrivals_parse_seven_digit_fractions():
    reqs = load_trace(AZURE_CONV, max_requests=500, rate_scale=2)
    hashes = [h for r in reqs for h in r.block_hashes]
    assert len(set(hashes)) == len(hashes)
    first_two = load_trace(AZURE_CONV, max_requests=2)
    assert first_two[1].arrival_s == pytest.approx(50.9951690 - 46.6805900, abs=1e-9)
    assert (first_two[0].input_tokens, first_two[0].output_tokens) == (374, 44)


def test_azure_time_zones_and_unsorted_rows(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2024-05-10 00:00:03.5+00:00,100,0\n"
                    "2024-05-10T01:00:01Z,200,5\n"
                    "2024-05-09 23:59:59.25-01:00,300,6\n")
    reqs = load_trace(path, time_scale=2.0)
    # the third row is 00:59:59.25 UTC: sorted between the others; output 0 becomes 1, as in bench
    assert [r.arrival_s for r in reqs] == pytest.approx([0.0, 2 * 3595.75, 2 * 3597.5])
    assert [r.input_tokens for r in reqs] == [100, 300, 200]
    assert [r.output_tokens for r in reqs] == [1, 6, 5]


# --- bad input ---------------------------------------------------------------------------------

GOOD = '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]}\n'


@pytest.mark.parametrize("line,field", [
    ('{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [1]', "not JSON"),
    ('[1, 2]', "not a JSON object"),
    ('{"timestamp": 0, "output_length": 2, "hash_ids": [1]}', '"input_length" is missing'),
    ('{"timestamp": 0, "input_length": -4, "output_length": 2, "hash_ids": [1]}', '"input_length"'),
    ('{"timestamp": 0, "input_length": 4, "output_length": -1, "hash_ids": [1]}', '"output_length"'),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1, "x"]}', '"hash_ids"'),
    ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1.5]}', '"hash_ids"'),
    ('{"timestamp": "soon", "input_length": 4, "output_length": 1, "hash_ids": []}', '"timestamp"'),
])
def test_malformed_mooncake_line_names_file_line_and_field(tmp_path, line, field):
    path = tmp_path / "trace.jsonl"
    path.write_text(GOOD + "\n" + line + "\n")
    with pytest.raises(ValueError) as err:
        load_trace(path)
    message = str(err.value)
    assert message.startswith(f"{path} line 3:") and field in message and "\n" not in message


@pytest.mark.parametrize("row,field", [
    ("2023-11-16 18:15:46.68,abc,3", '"ContextTokens"'),
    ("2023-11-16 18:15:46.68,-5,3", '"ContextTokens"'),
    ("2023-11-16 18:15:46.68,5,-3", '"GeneratedTokens"'),
    ("2023-11-16 18:15:46.68,5", '"GeneratedTokens" is missing'),
    ("2023-13-16 18:15:46.68,5,3", '"TIMESTAMP"'),
    ("yesterday,5,3", '"TIMESTAMP"'),
])
def test_malformed_azure_row_names_file_line_and_field(tmp_path, row, field):
    path = tmp_path / "trace.csv"
    path.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n{row}\n")
    with pytest.raises(ValueError, match=rf"^{path} line 3: field {field}") as err:
        load_trace(path)
    assert "\n" not in str(err.value)


def test_empty_traces_and_bad_arguments_raise(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    header_only = tmp_path / "empty.csv"
    header_only.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    no_column = tmp_path / "cols.csv"
    no_column.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.68,5\n")
    for path, match in ((empty, "no records"), (header_only, "no records"),
                        (no_column, 'line 1: field "GeneratedTokens" is missing from the header'),
                        (tmp_path / "missing.jsonl", "cannot read"), (tmp_path / "x.txt", "suffix")):
        with pytest.raises(ValueError, match=match):
            load_trace(path)
    for kwargs in ({"rate_scale": 0}, {"rate_scale": -1.0}, {"block_size": 0}, {"time_scale": -1.0},
                   {"tokens_per_hash_block": 0}, {"max_requests": 0}, {"kind": "parquet"}):
        with pytest.raises(ValueError):
            load_trace(MOONCAKE, **kwargs)
    for kwargs in ({"rate": 0.0}, {"duration_s": None}, {"num_requests": 5}, {"cv": 0.0},
                   {"peak_to_trough": 0.5}, {"input_sigma": -1.0}):
        with pytest.raises(ValueError):
            synthetic("day", **{"rate": 1.0, "duration_s": 10.0, "input_tokens": 8, "output_tokens": 1,
                                **kwargs})
    with pytest.raises(ValueError, match="kind"):
        synthetic("weibull", rate=1.0, num_requests=3, input_tokens=8, output_tokens=1)


def test_arrivals_import_no_runtime_frontend_worker_or_bench():
    tree = ast.parse(Path(arrivals.__file__).read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    banned = ("tokenmill.runtime", "tokenmill.api", "tokenmill.worker", "tokenmill.bench")
    assert not [name for name in imported if name.startswith(banned)]
