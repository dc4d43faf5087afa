"""Arrivals for the fleet simulator: request traces → `TraceRequest`s.

Every source (these traces, and the synthetic load of `sim.fleet.synthetic`) ends in the same
list, built by `build_requests`: sorted by arrival, ids `r0, r1, ...` in that order, each
request carrying the chained hashes of its prompt's full blocks (`len(block_hashes) ==
input_tokens // block_size`), built with the one chained-hash definition of `kv.hashing`
(`h[0] = local[0]`, `h[i] = chain_hash(h[i-1], local[i])`; chain seed 0; computed in numpy
by `sim.fleet.block_chains`). What a block's *local* hash is depends on the source:

- **Mooncake JSONL** (`timestamp` ms, `input_length`, `output_length`, `hash_ids`). Each hash
  id stands for `tokens_per_hash_block` tokens, and the records are fitted exactly as
  `tokenmill bench serve --trace` fits them (`bench.trace_replay.trace_requests`, whose
  `HashBlockSynth` turns them into real token ids): the first `max_requests` records in file
  order; arrival `(timestamp - earliest) / 1000 * time_scale`; input length
  `max(1, round(input_length * tokens_per_hash_block / 512))` cut to `max_input_tokens`;
  output `max(1, output_length)` cut to `max_output_tokens`; the prompt is the hash-id blocks
  concatenated and cut to the input length (hash ids past it are dropped), padded with
  request-unique tokens if the ids run short. A full block that lies inside hash id `k` as its
  sub-block `j` has local hash `xxh3_64(pack("<QQ", k, j))`; when `tokens_per_hash_block` is
  not a multiple of `block_size` a block can span several ids, and its local hash folds them
  with its offset. A block touching padding is request-unique. So two requests share exactly
  the leading full blocks that the live system's hashes of those token ids share
  (`tests/sim/test_fleet_arrivals.py` checks this against bench itself).
- **Azure 2023 CSV** (`TIMESTAMP,ContextTokens,GeneratedTokens`): no prefix sharing is
  recorded, so every request is all padding: unique chains. Arrival is seconds since the
  earliest row, times `time_scale`; the caps and `max_requests` apply as above.
- **Synthetic** (`sim.fleet.synthetic`): unique chains, as Azure.

`rate_scale = K` grows a trace to a fleet: K time-shifted copies superposed, copy `c` shifted
by `c / K` of the trace's mean inter-arrival gap (deterministic, so the window counts are K
times the original's, the shape and the time span are kept to within one gap, and copies
interleave instead of arriving in lock-step). A fractional K adds copy `floor(K)` thinned to
the fraction (each of its requests kept with probability `K - floor(K)`, seeded). Copies of a
Mooncake trace are K independent user populations that behave alike: copy `c` keeps all the
prefix sharing inside itself, but its chains are namespaced by `c` (folded into the seed of
block 0's local hash, as ARCHITECTURE.md "Block hashing" folds an extra key), so copies share nothing with each
other. That is what a user sizing a fleet for K times the users expects: the per-request hit
rate of the original trace, not a copy hitting its twin's freshly computed prefix. (A prefix
every user truly shares, such as one system prompt, becomes K prefixes: a slight
under-estimate of reuse, never an over-estimate.) Copy 0 is the unscaled trace itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tokenmill.kv.hashing import DEFAULT_BLOCK_SIZE
from tokenmill.sim.fleet.block_chains import Blocks, chain_blocks, split_chains
from tokenmill.sim.fleet.trace_files import read_azure, read_mooncake
from tokenmill.sim.fleet.trace_rows import Rows

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces (as workloads.prompt_synth)
_MASK64 = (1 << 64) - 1


@dataclass(slots=True)
class TraceRequest:
    request_id: str           # "r0", "r1", ... in arrival order (after merging/scaling)
    arrival_s: float          # seconds from the start of the run
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's FULL blocks of `block_size` tokens
    tenant: str = ""  # whose request (the simulator's tenants, `admission.py`); "" the default tenant's


# ---------------------------------------------------------------------------------------------
# Public API


def load_trace(
    path: str | Path,
    kind: str = "auto",
    *,
    block_size: int = DEFAULT_BLOCK_SIZE,
    tokens_per_hash_block: int = MOONCAKE_BLOCK_TOKENS,
    time_scale: float = 1.0,
    max_requests: int | None = None,
    max_input_tokens: int | None = None,
    max_output_tokens: int | None = None,
    rate_scale: float = 1.0,
    seed: int = 0,
) -> list[TraceRequest]:
    """A trace file as simulator requests (see the module docstring for every rule).

    `kind`: "mooncake" (JSONL), "azure" (CSV) or "auto" (by suffix: .jsonl/.json, .csv).
    `tokens_per_hash_block` only matters for Mooncake. `seed` only drives the thinning of a
    fractional `rate_scale`. Raises ValueError, one line naming the file, line and field, for
    a malformed record, an empty trace or a bad argument.
    """
    path = Path(path)
    _check_fit_args(block_size, tokens_per_hash_block, time_scale, max_requests,
                    max_input_tokens, max_output_tokens, rate_scale)
    kind = _trace_kind(path, kind)
    if kind == "mooncake":
        rows = _fit_mooncake(read_mooncake(path, max_requests), tokens_per_hash_block, time_scale)
    else:
        rows = _fit_azure(read_azure(path, max_requests), time_scale)
    rows.input_tokens = _cap(rows.input_tokens, max_input_tokens)
    rows.output_tokens = _cap(np.maximum(rows.output_tokens, 1), max_output_tokens)
    base, copy, arrival = _superpose(rows.arrival_s, rate_scale, seed)
    return build_requests(rows, base, copy, arrival, block_size, tokens_per_hash_block)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_fit_args(block_size: int, tokens_per_hash_block: int, time_scale: float,
                    max_requests: int | None, max_input_tokens: int | None,
                    max_output_tokens: int | None, rate_scale: float) -> None:
    """Every argument of `load_trace` in range, or ValueError naming it."""
    check_positive_int("block_size", block_size)
    check_positive_int("tokens_per_hash_block", tokens_per_hash_block)
    for name, value in (("max_requests", max_requests), ("max_input_tokens", max_input_tokens),
                        ("max_output_tokens", max_output_tokens)):
        if value is not None:
            check_positive_int(name, value)
    if not (math.isfinite(time_scale) and time_scale >= 0):
        raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale}")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")


def check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def _trace_kind(path: Path, kind: str) -> str:
    """"mooncake" or "azure": `kind` itself, or told by the file's suffix for "auto"."""
    if kind in ("mooncake", "azure"):
        return kind
    if kind != "auto":
        raise ValueError(f'kind must be "auto", "mooncake" or "azure", got {kind!r}')
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        return "mooncake"
    if suffix == ".csv":
        return "azure"
    raise ValueError(f"{path}: cannot tell the trace kind from the suffix {suffix!r} "
                     "(.jsonl is Mooncake, .csv is Azure); give kind")


# ---------------------------------------------------------------------------------------------
# Fitting records (as bench.trace_replay.trace_requests does)


def _fit_mooncake(records: list[tuple[float, int, int, list[int]]], tokens_per_hash_block: int,
                  time_scale: float) -> Rows:
    """Scaled lengths (`max(1, round(len * tpb / 512))`, as HashBlockSynth) and arrivals."""
    start = min(r[0] for r in records)
    arrival = np.array([(r[0] - start) / 1000.0 * time_scale for r in records], dtype=np.float64)
    inputs = [max(1, round(r[1] * tokens_per_hash_block / MOONCAKE_BLOCK_TOKENS)) for r in records]
    kept = [r[3][:-(-length // tokens_per_hash_block)] for r, length in zip(records, inputs)]
    counts = np.array([len(ids) for ids in kept], dtype=np.int64)
    flat = np.fromiter((h for ids in kept for h in ids), dtype=np.uint64, count=int(counts.sum()))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return Rows(arrival, np.array(inputs, dtype=np.int64),
                 np.array([r[2] for r in records], dtype=np.int64), starts, counts,
                 np.append(flat, np.uint64(0)))


def _fit_azure(rows: list[tuple[int, float, int, int]], time_scale: float) -> Rows:
    """Arrival = seconds since the earliest row, time-scaled; no hash ids."""
    whole = np.array([r[0] for r in rows], dtype=np.int64)
    seconds = (whole - whole.min()).astype(np.float64) + np.array([r[1] for r in rows])
    arrival = (seconds - seconds.min()) * time_scale
    return Rows.unshared(arrival, np.array([r[2] for r in rows]), np.array([r[3] for r in rows]))


def _cap(values: np.ndarray, cap: int | None) -> np.ndarray:
    return values if cap is None else np.minimum(values, cap)


# ---------------------------------------------------------------------------------------------
# Rate scaling: superposed, time-shifted copies


def _superpose(arrival_s: np.ndarray, rate_scale: float,
               seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(row index, copy index, arrival) of every request of `rate_scale` superposed copies.

    Copy c is shifted by c / K of the mean inter-arrival gap; copy floor(K), if K is not a
    whole number, keeps each request with probability K - floor(K) (seeded by `seed`). Sorted
    by (arrival, copy, row), so the order is total and deterministic.
    """
    n = len(arrival_s)
    gap = (arrival_s.max() - arrival_s.min()) / (n - 1) if n > 1 else 0.0
    whole, fraction = int(math.floor(rate_scale)), rate_scale - math.floor(rate_scale)
    rows, copies = [], []
    for copy in range(whole + (1 if fraction > 0 else 0)):
        keep = np.arange(n, dtype=np.int64)
        if copy == whole:
            keep = keep[np.random.default_rng([seed, 3]).random(n) < fraction]
        rows.append(keep)
        copies.append(np.full(len(keep), copy, dtype=np.int64))
    row, copy = np.concatenate(rows), np.concatenate(copies)
    if len(row) == 0:
        raise ValueError(f"rate_scale {rate_scale} keeps none of the trace's {n} requests")
    arrival = arrival_s[row] + copy * (gap / rate_scale)
    order = np.lexsort((row, copy, arrival))
    return row[order], copy[order], arrival[order]


# ---------------------------------------------------------------------------------------------
# The request list


def build_requests(rows: Rows, row: np.ndarray, copy: np.ndarray, arrival: np.ndarray,
                   block_size: int, tokens_per_hash_block: int) -> list[TraceRequest]:
    """The requests, already in arrival order: request i replays `row[i]` as copy `copy[i]`."""
    n = len(row)
    inputs = rows.input_tokens[row]
    lengths = inputs // block_size
    order = np.argsort(-lengths, kind="stable")
    pad = np.uint64(_MASK64) - np.arange(n, dtype=np.uint64)
    blocks = Blocks(rows, row[order], copy[order].astype(np.uint64), pad[order], block_size,
                    tokens_per_hash_block)
    hashes, offsets = chain_blocks(blocks, lengths[order])
    chains: list[tuple[int, ...]] = [()] * n
    for rank, chain in zip(order.tolist(), split_chains(hashes, offsets, lengths[order])):
        chains[rank] = chain
    outputs = rows.output_tokens[row]
    return [TraceRequest(f"r{i}", a, s, o, c) for i, (a, s, o, c) in enumerate(
        zip(arrival.tolist(), inputs.tolist(), outputs.tolist(), chains))]
