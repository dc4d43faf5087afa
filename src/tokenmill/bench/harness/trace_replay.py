"""Mooncake-format JSONL traces → requests for `tokenmill bench serve --trace`.

Each line is `{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [int, ...]}`, where hash id i names the i-th 512-token block of the prompt
and equal ids mean equal blocks. Replay keeps the arrival pattern (scaled by
`time_scale`) and the prefix sharing (through `HashBlockSynth`), and shrinks prompts by
tokens_per_hash_block / 512 so a small machine can serve them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenmill.workloads.prompt_synth import HashBlockSynth, RequestSpec

TRACE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")


@dataclass(slots=True, frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(slots=True, frozen=True)
class TraceFit:
    """How a trace is fitted to the machine: speed, count and length limits."""
    time_scale: float = 1.0
    max_requests: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.time_scale < 0:
            raise ValueError(f"--time-scale must be >= 0, got {self.time_scale}")
        for name in ("max_requests", "max_input_tokens", "max_output_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _parse_line(line: str, where: str) -> TraceRecord:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--trace {where}: not JSON ({exc.msg})") from exc
    if not isinstance(raw, dict) or any(key not in raw for key in TRACE_FIELDS):
        raise ValueError(f"--trace {where}: a record needs the keys {', '.join(TRACE_FIELDS)}")
    hash_ids = raw["hash_ids"]
    numbers_ok = all(isinstance(raw[k], (int, float)) and raw[k] >= 0 for k in TRACE_FIELDS[:3])
    if not numbers_ok or not isinstance(hash_ids, list) or not all(isinstance(h, int) for h in hash_ids):
        raise ValueError(f"--trace {where}: timestamp/input_length/output_length must be numbers >= 0 "
                         "and hash_ids a list of integers")
    return TraceRecord(float(raw["timestamp"]), int(raw["input_length"]), int(raw["output_length"]),
                       tuple(hash_ids))


def read_trace(path: str | Path, max_records: int | None = None) -> list[TraceRecord]:
    """The first `max_records` records (all if None), in file order; blank lines are skipped."""
    records: list[TraceRecord] = []
    try:
        with open(path, encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if max_records is not None and len(records) >= max_records:
                    break
                if line.strip():
                    records.append(_parse_line(line, f"{path}:{number}"))
    except OSError as exc:
        raise ValueError(f"--trace {path}: cannot read ({exc.strerror})") from exc
    if not records:
        raise ValueError(f"--trace {path}: no records")
    return records


def trace_requests(records: list[TraceRecord], synth: HashBlockSynth, fit: TraceFit) -> list[RequestSpec]:
    """Requests for the (capped) records: scaled prompts, arrivals relative to the first record."""
    chosen = records[:fit.max_requests] if fit.max_requests is not None else records
    start_ms = min(r.timestamp_ms for r in chosen)
    specs = []
    for index, record in enumerate(chosen):
        length = synth.scaled_length(record.input_length)
        if fit.max_input_tokens is not None:
            length = min(length, fit.max_input_tokens)
        output_len = max(1, record.output_length)
        if fit.max_output_tokens is not None:
            output_len = min(output_len, fit.max_output_tokens)
        arrival = (record.timestamp_ms - start_ms) / 1000.0 * fit.time_scale
        specs.append(RequestSpec(synth.prompt(record.hash_ids, length, index), output_len, arrival,
                                 record.hash_ids))
    return specs
