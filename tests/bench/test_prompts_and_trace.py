"""Prompt synthesis and Mooncake trace replay for `tokenmill bench serve` (no server needed)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenmill.bench.harness.trace_replay import TraceFit, read_trace, trace_requests
from tokenmill.datasets import MOONCAKE_TRACE, data_file
from tokenmill.workloads.prompt_synth import (
    HashBlockSynth,
    SyntheticShape,
    TokenSpace,
    poisson_arrivals,
    synthetic_requests,
)

REAL_TRACE = data_file(MOONCAKE_TRACE)
SPACE = TokenSpace(vocab_size=2048, min_id=3)


def _write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_equal_hash_ids_give_identical_blocks_and_prefixes() -> None:
    synth = HashBlockSynth(SPACE, tokens_per_block=16, seed=7)
    a = synth.prompt([10, 11, 12], 48, request_index=0)
    b = synth.prompt([10, 11, 99], 48, request_index=1)
    assert a[:32] == b[:32]  # two shared hash blocks → 32 identical tokens
    assert a[32:] != b[32:]
    again = HashBlockSynth(SPACE, tokens_per_block=16, seed=7)  # a fresh synthesizer, other order
    assert again.prompt([99], 16, 5) == b[32:] and again.prompt([10, 11, 12], 48, 3) == a
    assert HashBlockSynth(SPACE, 16, seed=8).prompt([10], 16, 0) != a[:16]


def test_trace_prompts_are_scaled_padded_and_in_the_token_space() -> None:
    synth = HashBlockSynth(SPACE, tokens_per_block=16, seed=0)
    assert synth.scaled_length(40160) == round(40160 * 16 / 512)
    assert synth.scaled_length(13) == 1
    long = synth.prompt([1], 40, request_index=0)  # one block of 16, then padding
    other = synth.prompt([2], 40, request_index=1)
    assert len(long) == 40 and long[:16] == synth.block(1)
    assert long[16:] != other[16:]  # padding is unique per request: no sharing the trace lacks
    assert all(3 <= t < 2048 for t in long + other)


def test_real_trace_replay_keeps_sharing_arrivals_and_caps(tmp_path: Path) -> None:
    records = read_trace(REAL_TRACE, max_records=40)
    assert len(records) == 40 and records[0].hash_ids[:3] == (0, 1, 2)
    fit = TraceFit(time_scale=0.1, max_requests=30, max_input_tokens=200, max_output_tokens=8)
    specs = trace_requests(records, HashBlockSynth(SPACE, 16, seed=0), fit)
    assert len(specs) == 30
    for spec, record in zip(specs, records):
        assert spec.arrival_s == pytest.approx((record.timestamp_ms - records[0].timestamp_ms) / 1000 * 0.1)
        assert len(spec.prompt) == min(200, max(1, round(record.input_length * 16 / 512)))
        assert 1 <= spec.output_len <= 8
    # requests whose trace blocks coincide got the same tokens for those blocks
    seen: dict[int, list[int]] = {}
    for spec in specs:
        for i, h in enumerate(spec.hash_ids[: len(spec.prompt) // 16]):
            block = spec.prompt[16 * i: 16 * (i + 1)]
            assert seen.setdefault(h, block) == block


def test_shared_hash_ids_in_a_trace_give_shared_prompt_prefixes(tmp_path: Path) -> None:
    rows = [{"timestamp": 0, "input_length": 1024, "output_length": 3, "hash_ids": [1, 2]},
            {"timestamp": 500, "input_length": 1536, "output_length": 3, "hash_ids": [1, 2, 3]}]
    specs = trace_requests(read_trace(_write_trace(tmp_path / "t.jsonl", rows)),
                           HashBlockSynth(SPACE, 32, seed=0), TraceFit(time_scale=2.0))
    assert [len(s.prompt) for s in specs] == [64, 96]
    assert specs[1].prompt[:64] == specs[0].prompt
    assert [s.arrival_s for s in specs] == [0.0, 1.0]


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ('{"timestamp": 0, "input_length": 5}', "needs the keys"),
    ('{"timestamp": 0, "input_length": -5, "output_length": 1, "hash_ids": []}', "numbers >= 0"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "list of integers"),
])
def test_bad_trace_lines_name_the_flag_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ValueError, match=rf"--trace .*bad.jsonl:1: .*{message}"):
        read_trace(path)


def test_missing_or_empty_trace_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--trace .*cannot read"):
        read_trace(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no records"):
        read_trace(tmp_path / "empty.jsonl")


def test_synthetic_requests_are_seeded_in_range_and_share_group_prefixes() -> None:
    shape = SyntheticShape(10, 20, 3, 5, prefix_len=8, num_prefix_groups=2)
    specs = synthetic_requests(12, shape, SPACE, seed=3)
    assert [s.prompt for s in specs] == [s.prompt for s in synthetic_requests(12, shape, SPACE, seed=3)]
    assert all(18 <= len(s.prompt) <= 28 and 3 <= s.output_len <= 5 for s in specs)
    assert all(3 <= t < 2048 for s in specs for t in s.prompt)
    assert specs[0].prompt[:8] == specs[2].prompt[:8] != specs[1].prompt[:8]
    assert specs[0].prompt[8:16] != specs[2].prompt[8:16]


def test_poisson_arrivals_start_at_zero_and_increase() -> None:
    specs = synthetic_requests(2000, SyntheticShape(1, 1, 1, 1), SPACE, seed=0)
    poisson_arrivals(specs, rate_per_s=50.0, seed=0)
    arrivals = [s.arrival_s for s in specs]
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    assert arrivals[-1] / (len(arrivals) - 1) == pytest.approx(1 / 50, rel=0.1)  # seeded: deterministic


@pytest.mark.parametrize("build, flag", [
    (lambda: SyntheticShape(0, 5, 1, 1), "--min-input"),
    (lambda: SyntheticShape(5, 4, 1, 1), "--max-input"),
    (lambda: SyntheticShape(1, 1, 1, 1, prefix_len=-1), "--prefix-len"),
    (lambda: TokenSpace(vocab_size=3, min_id=3), "--vocab-size"),
    (lambda: HashBlockSynth(SPACE, 0), "--tokens-per-hash-block"),
    (lambda: TraceFit(time_scale=-1), "--time-scale"),
    (lambda: TraceFit(max_requests=0), "--max-requests"),
    (lambda: poisson_arrivals([], 0.0, 0), "--request-rate"),
])
def test_bad_values_name_the_flag(build, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        build()
