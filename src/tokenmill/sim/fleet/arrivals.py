"""Arrivals for the fleet simulator: request traces and synthetic load → `TraceRequest`s.

Every source ends in the same list: sorted by arrival, ids `r0, r1, ...` in that order, each
request carrying the chained hashes of its prompt's full blocks (`len(block_hashes) ==
input_tokens // block_size`), built with the one chained-hash definition of `kv.hashing`
(`h[0] = local[0]`, `h[i] = chain_hash(h[i-1], local[i])`; chain seed 0). What a block's
*local* hash is depends on the source:

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
- **Synthetic** (`synthetic`): Poisson, gamma (a coefficient of variation for bursts) or a
  day-shaped rate; unique chains.

`rate_scale = K` grows a trace to a fleet: K time-shifted copies superposed, copy `c` shifted
by `c / K` of the trace's mean inter-arrival gap (deterministic, so the window counts are K
times the original's, the shape and the time span are kept to within one gap, and copies
interleave instead of arriving in lock-step). A fractional K adds copy `floor(K)` thinned to
the fraction (each of its requests kept with probability `K - floor(K)`, seeded). Copies of a
Mooncake trace are K independent user populations that behave alike: copy `c` keeps all the
prefix sharing inside itself, but its chains are namespaced by `c` (folded into the seed of
block 0's local hash, as DESIGN.md folds an extra key), so copies share nothing with each
other. That is what a user sizing a fleet for K times the users expects: the per-request hit
rate of the original trace, not a copy hitting its twin's freshly computed prefix. (A prefix
every user truly shares, such as one system prompt, becomes K prefixes: a slight
under-estimate of reuse, never an over-estimate.) Copy 0 is the unscaled trace itself.

Speed: local and chained hashes are xxh3_64 of 16 bytes, computed for every block at once in
numpy (`_xxh3_pair`, bit-exact with `xxhash.xxh3_64_intdigest`, tested), the chain running
over block positions with all requests at a position in one vector. Unique (padding) blocks
use `pack("<QQ", 2**64 - 1 - request_index, block_index)` as their local input, which no hash
id (< 2**63) can produce.
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MOONCAKE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces (as bench.prompt_synth)
_HASH_ID_LIMIT = 1 << 63
_MASK64 = (1 << 64) - 1
_AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_TIME_RE = re.compile(r"\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                      r"\s*(Z|[+-]\d{2}:?\d{2})?\s*$")
_TIME_EXAMPLE = "2023-11-16 18:15:46.6805900"


@dataclass(slots=True)
class TraceRequest:
    request_id: str           # "r0", "r1", ... in arrival order (after merging/scaling)
    arrival_s: float          # seconds from the start of the run
    input_tokens: int
    output_tokens: int
    block_hashes: tuple[int, ...]  # chained hashes of the prompt's FULL blocks of `block_size` tokens


# ---------------------------------------------------------------------------------------------
# Public API


def load_trace(
    path: str | Path,
    kind: str = "auto",
    *,
    block_size: int = 16,
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
        rows = _fit_mooncake(_read_mooncake(path, max_requests), tokens_per_hash_block, time_scale)
    else:
        rows = _fit_azure(_read_azure(path, max_requests), time_scale)
    rows.input_tokens = _cap(rows.input_tokens, max_input_tokens)
    rows.output_tokens = _cap(np.maximum(rows.output_tokens, 1), max_output_tokens)
    base, copy, arrival = _superpose(rows.arrival_s, rate_scale, seed)
    return _build(rows, base, copy, arrival, block_size, tokens_per_hash_block)


def synthetic(
    kind: str = "poisson",
    *,
    rate: float,
    input_tokens: int,
    output_tokens: int,
    duration_s: float | None = None,
    num_requests: int | None = None,
    input_sigma: float = 0.0,
    output_sigma: float = 0.0,
    cv: float = 1.0,
    period_s: float = 86_400.0,
    peak_to_trough: float = 4.0,
    block_size: int = 16,
    seed: int = 0,
) -> list[TraceRequest]:
    """Seeded synthetic load; the same arguments always give the same list.

    Arrivals (give exactly one of `duration_s`, arrivals in [0, duration_s), or
    `num_requests`), at a mean of `rate` requests/s:
    - "poisson": exponential gaps.
    - "gamma": gamma gaps with coefficient of variation `cv` (1 = Poisson, > 1 bursty).
    - "day": a Poisson process of rate `rate * (1 - a cos(2π t / period_s))`, a =
      (R - 1) / (R + 1) for R = `peak_to_trough`: the trough at t = 0, the peak at period_s / 2,
      the mean `rate` over a period; drawn by thinning a Poisson process of the peak rate.
    Lengths: `input_tokens` / `output_tokens` exactly when their sigma is 0, else lognormal with
    that mean and log-space sigma, rounded, at least 1. Lengths come from their own random
    streams, so request i has the same lengths whatever the arrival kind or rate. No prefixes
    are shared: every request has its own chain.
    """
    _check_synthetic_args(kind, rate, input_tokens, output_tokens, duration_s, num_requests,
                          input_sigma, output_sigma, cv, period_s, peak_to_trough, block_size)
    times = _arrival_times(_process(kind, rate, cv, period_s, peak_to_trough),
                           np.random.default_rng([seed, 0]), duration_s, num_requests)
    n = len(times)
    rows = _Rows.unshared(times,
                          _lengths(np.random.default_rng([seed, 1]), input_tokens, input_sigma, n),
                          _lengths(np.random.default_rng([seed, 2]), output_tokens, output_sigma, n))
    index = np.arange(n, dtype=np.int64)  # no hash ids, so tokens_per_hash_block is moot
    return _build(rows, index, np.zeros(n, dtype=np.int64), times, block_size, MOONCAKE_BLOCK_TOKENS)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_fit_args(block_size: int, tokens_per_hash_block: int, time_scale: float,
                    max_requests: int | None, max_input_tokens: int | None,
                    max_output_tokens: int | None, rate_scale: float) -> None:
    """Every argument of `load_trace` in range, or ValueError naming it."""
    _positive_int("block_size", block_size)
    _positive_int("tokens_per_hash_block", tokens_per_hash_block)
    for name, value in (("max_requests", max_requests), ("max_input_tokens", max_input_tokens),
                        ("max_output_tokens", max_output_tokens)):
        if value is not None:
            _positive_int(name, value)
    if not (math.isfinite(time_scale) and time_scale >= 0):
        raise ValueError(f"time_scale must be a finite number >= 0, got {time_scale}")
    if not (math.isfinite(rate_scale) and rate_scale > 0):
        raise ValueError(f"rate_scale must be a finite number > 0, got {rate_scale}")


def _check_synthetic_args(kind: str, rate: float, input_tokens: int, output_tokens: int,
                          duration_s: float | None, num_requests: int | None,
                          input_sigma: float, output_sigma: float, cv: float, period_s: float,
                          peak_to_trough: float, block_size: int) -> None:
    """Every argument of `synthetic` in range, or ValueError naming it."""
    if kind not in ("poisson", "gamma", "day"):
        raise ValueError(f'kind must be "poisson", "gamma" or "day", got {kind!r}')
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens),
                        ("block_size", block_size)):
        _positive_int(name, value)
    if (duration_s is None) == (num_requests is None):
        raise ValueError("give exactly one of duration_s and num_requests")
    if num_requests is not None:
        _positive_int("num_requests", num_requests)
    for name, value in (("rate", rate), ("cv", cv), ("period_s", period_s),
                        ("duration_s", 1.0 if duration_s is None else duration_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value}")
    for name, value in (("input_sigma", input_sigma), ("output_sigma", output_sigma)):
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    if not (math.isfinite(peak_to_trough) and peak_to_trough >= 1):
        raise ValueError(f"peak_to_trough must be a finite number >= 1, got {peak_to_trough}")


def _positive_int(name: str, value: int) -> None:
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
# Reading trace files: one line-numbered error per malformed record


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, line) of the file's non-blank lines; unreadable files raise ValueError."""
    try:
        with open(path, encoding="utf-8-sig", newline="") as handle:
            for number, line in enumerate(handle, start=1):
                if line.strip():
                    yield number, line
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ValueError(f"{path}: cannot read ({reason})") from exc


def _bad(path: Path, line: int, field: str, what: str) -> ValueError:
    return ValueError(f'{path} line {line}: field "{field}" {what}')


def _as_int(value: object) -> int | None:
    """`value` as an int if it is a whole number (int, integral float, or such a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _read_mooncake(path: Path, max_requests: int | None) -> list[tuple[float, int, int, list[int]]]:
    """(timestamp ms, input_length, output_length, hash_ids) of the first `max_requests` records."""
    records = []
    for number, line in _lines(path):
        if max_requests is not None and len(records) >= max_requests:
            break
        records.append(_parse_mooncake(path, number, line))
    if not records:
        raise ValueError(f"{path}: the trace has no records")
    return records


def _parse_mooncake(path: Path, number: int, line: str) -> tuple[float, int, int, list[int]]:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} line {number}: not JSON ({exc.msg})") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} line {number}: not a JSON object")
    for field in _MOONCAKE_FIELDS:
        if field not in raw:
            raise _bad(path, number, field, "is missing")
    stamp = raw["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not (
            math.isfinite(stamp) and stamp >= 0):
        raise _bad(path, number, "timestamp", "must be a number >= 0 (milliseconds)")
    input_length, output_length = _as_int(raw["input_length"]), _as_int(raw["output_length"])
    if input_length is None or input_length < 1:
        raise _bad(path, number, "input_length", "must be an integer >= 1")
    if output_length is None or output_length < 0:
        raise _bad(path, number, "output_length", "must be an integer >= 0")
    hash_ids = raw["hash_ids"]
    if not isinstance(hash_ids, list) or not all(
            type(h) is int and 0 <= h < _HASH_ID_LIMIT for h in hash_ids):
        raise _bad(path, number, "hash_ids", "must be a list of integers in [0, 2**63)")
    return float(stamp), input_length, output_length, hash_ids


def _read_azure(path: Path, max_requests: int | None) -> list[tuple[int, float, int, int]]:
    """(whole seconds, fraction, ContextTokens, GeneratedTokens) of the first `max_requests` rows."""
    lines = _lines(path)
    header = next(lines, None)
    if header is None:
        raise ValueError(f"{path}: the trace has no records")
    names = [name.strip() for name in next(csv.reader([header[1]]))]
    for field in _AZURE_FIELDS:
        if field not in names:
            raise _bad(path, header[0], field, "is missing from the header")
    columns = [names.index(field) for field in _AZURE_FIELDS]
    rows = []
    for number, line in lines:
        if max_requests is not None and len(rows) >= max_requests:
            break
        rows.append(_parse_azure(path, number, next(csv.reader([line])), columns))
    if not rows:
        raise ValueError(f"{path}: the trace has no records")
    return rows


def _parse_azure(path: Path, number: int, cells: list[str],
                 columns: list[int]) -> tuple[int, float, int, int]:
    for field, column in zip(_AZURE_FIELDS, columns):
        if column >= len(cells):
            raise _bad(path, number, field, "is missing")
    stamp = _parse_time(cells[columns[0]])
    if stamp is None:
        raise _bad(path, number, "TIMESTAMP", f"must be a time like {_TIME_EXAMPLE}")
    context, generated = _as_int(cells[columns[1]]), _as_int(cells[columns[2]])
    if context is None or context < 1:
        raise _bad(path, number, "ContextTokens", "must be an integer >= 1")
    if generated is None or generated < 0:
        raise _bad(path, number, "GeneratedTokens", "must be an integer >= 0")
    return stamp[0], stamp[1], context, generated


def _parse_time(text: str) -> tuple[int, float] | None:
    """`YYYY-MM-DD HH:MM:SS[.fraction][Z|±HH:MM]` → (whole seconds since year 1, fraction).

    Parsed by hand: the Azure traces carry 7 fractional digits, which `datetime` refuses on
    some Python versions. Kept as an integer plus a fraction so that differences between rows
    stay exact to the sub-microsecond digits (a float of ~6e10 s would lose them).
    """
    match = _TIME_RE.match(text)
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in match.groups()[:6])
    try:
        days = dt.date(year, month, day).toordinal()
    except ValueError:
        return None
    if hour > 23 or minute > 59 or second > 60:
        return None
    whole = days * 86_400 + hour * 3_600 + minute * 60 + second - _zone_seconds(match.group(8))
    fraction = float("0." + match.group(7)) if match.group(7) else 0.0
    return whole, fraction


def _zone_seconds(zone: str | None) -> int:
    if not zone or zone == "Z":
        return 0
    digits = zone[1:].replace(":", "")
    offset = int(digits[:2]) * 3_600 + int(digits[2:]) * 60
    return offset if zone[0] == "+" else -offset


# ---------------------------------------------------------------------------------------------
# Fitting records (as bench.trace_replay.trace_requests does)


@dataclass(slots=True)
class _Rows:
    """A fitted trace, index-aligned arrays in file order.

    Row r's hash ids are `hid_flat[hid_start[r] : hid_start[r] + hid_count[r]]`, kept only as
    far as the prompt reaches (`ceil(input / tokens_per_hash_block)`); `hid_flat` always has
    one more (sentinel) entry so that masked gathers never index an empty array.
    """
    arrival_s: np.ndarray      # float64, from the earliest row, time-scaled
    input_tokens: np.ndarray   # int64
    output_tokens: np.ndarray  # int64
    hid_start: np.ndarray      # int64
    hid_count: np.ndarray      # int64
    hid_flat: np.ndarray       # uint64

    @classmethod
    def unshared(cls, arrival_s: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> _Rows:
        """Rows without hash ids: every prompt is request-unique."""
        zeros = np.zeros(len(arrival_s), dtype=np.int64)
        return cls(np.asarray(arrival_s, dtype=np.float64), np.asarray(inputs, dtype=np.int64),
                   np.asarray(outputs, dtype=np.int64), zeros, zeros.copy(),
                   np.zeros(1, dtype=np.uint64))


def _fit_mooncake(records: list[tuple[float, int, int, list[int]]], tokens_per_hash_block: int,
                  time_scale: float) -> _Rows:
    """Scaled lengths (`max(1, round(len * tpb / 512))`, as HashBlockSynth) and arrivals."""
    start = min(r[0] for r in records)
    arrival = np.array([(r[0] - start) / 1000.0 * time_scale for r in records], dtype=np.float64)
    inputs = [max(1, round(r[1] * tokens_per_hash_block / MOONCAKE_BLOCK_TOKENS)) for r in records]
    kept = [r[3][:-(-length // tokens_per_hash_block)] for r, length in zip(records, inputs)]
    counts = np.array([len(ids) for ids in kept], dtype=np.int64)
    flat = np.fromiter((h for ids in kept for h in ids), dtype=np.uint64, count=int(counts.sum()))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    return _Rows(arrival, np.array(inputs, dtype=np.int64),
                 np.array([r[2] for r in records], dtype=np.int64), starts, counts,
                 np.append(flat, np.uint64(0)))


def _fit_azure(rows: list[tuple[int, float, int, int]], time_scale: float) -> _Rows:
    """Arrival = seconds since the earliest row, time-scaled; no hash ids."""
    whole = np.array([r[0] for r in rows], dtype=np.int64)
    seconds = (whole - whole.min()).astype(np.float64) + np.array([r[1] for r in rows])
    arrival = (seconds - seconds.min()) * time_scale
    return _Rows.unshared(arrival, np.array([r[2] for r in rows]), np.array([r[3] for r in rows]))


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
# Vectorised xxh3_64 of 16 bytes, and the chains


_BITFLIP1 = np.uint64(0x6782737BEA4239B9)  # readLE64(kSecret + 24) ^ readLE64(kSecret + 32)
_BITFLIP2 = np.uint64(0xAF56BC3B0996523A)  # readLE64(kSecret + 40) ^ readLE64(kSecret + 48)
_PRIME_MX1 = np.uint64(0x165667919E3779F9)
_LOW32 = np.uint64(0xFFFFFFFF)
_SIXTEEN = np.uint64(16)


def _mul128_fold64(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Low 64 bits XOR high 64 bits of the 128-bit products x * y (xxh3's mul128_fold64).

    Four 32 x 32 → 64-bit products, as xxhash's portable path; in place where it can be,
    since this is the hot loop of every chain.
    """
    x_lo, x_hi, y_lo, y_hi = x & _LOW32, x >> 32, y & _LOW32, y >> 32
    lo_lo = x_lo * y_lo
    hi_lo = x_hi * y_lo
    x_lo *= y_hi  # lo_hi
    x_hi *= y_hi  # hi_hi
    cross = lo_lo >> 32
    cross += hi_lo & _LOW32
    cross += x_lo  # cannot overflow
    hi_lo >>= 32
    hi_lo += x_hi
    hi_lo += cross >> 32  # the upper 64 bits
    cross <<= 32
    lo_lo &= _LOW32
    cross |= lo_lo  # the lower 64 bits
    hi_lo ^= cross
    return hi_lo


def _xxh3_pair(a: np.ndarray, b: np.ndarray, seed: np.ndarray | None = None) -> np.ndarray:
    """xxh3_64 of `pack("<QQ", a, b)` with `seed` (0 if None), element-wise over uint64 arrays.

    Bit-exact with `xxhash.xxh3_64_intdigest` (its 9-16 byte path, default secret), so
    `_xxh3_pair(parent, local)` is `kv.hashing.chain_hash(parent, local)`.
    """
    flip1 = _BITFLIP1 if seed is None else _BITFLIP1 + seed
    flip2 = _BITFLIP2 if seed is None else _BITFLIP2 - seed
    lo, hi = a ^ flip1, b ^ flip2
    acc = _mul128_fold64(lo, hi)
    acc += _SIXTEEN
    acc += lo.byteswap(inplace=True)
    acc += hi
    acc ^= acc >> 37
    acc *= _PRIME_MX1
    acc ^= acc >> 32
    return acc


@dataclass(slots=True)
class _Blocks:
    """Local hashes of block position `i` for the `count` longest requests (sorted order).

    `row`, `copy` and `pad` are per request, sorted by block count, longest first, so the
    requests that have a block at position i are always a prefix of that order.
    """
    rows: _Rows
    row: np.ndarray   # int64: the trace row each request replays
    copy: np.ndarray  # uint64: its copy index (block 0's local seed)
    pad: np.ndarray   # uint64: 2**64 - 1 - request index, the input of its unique blocks
    block_size: int
    tokens_per_hash_block: int

    def local(self, i: int, count: int) -> np.ndarray:
        """Block i's local hashes: (hash id, sub-block) inside ids, (pad, i) touching padding."""
        tpb, size = self.tokens_per_hash_block, self.block_size
        first, last = i * size // tpb, (i * size + size - 1) // tpb
        row = self.row[:count]
        covered = self.rows.hid_count[row] > last  # the whole block lies inside hash ids
        content = self._hash_id(row, first, covered)
        if tpb % size == 0:
            tag = np.uint64((i * size % tpb) // size)  # sub-block j of its hash id
        else:
            for k in range(first + 1, last + 1):
                content = _xxh3_pair(content, self._hash_id(row, k, covered))
            tag = np.uint64(((i * size % tpb) << 32) | (last - first + 1))  # offset, ids spanned
        a = np.where(covered, content, self.pad[:count])
        b = np.where(covered, tag, np.uint64(i))
        return _xxh3_pair(a, b, self.copy[:count] if i == 0 else None)

    def _hash_id(self, row: np.ndarray, k: int, covered: np.ndarray) -> np.ndarray:
        """Hash id k of each row (the sentinel where the row is not covered)."""
        index = np.where(covered, self.rows.hid_start[row] + k, len(self.rows.hid_flat) - 1)
        return self.rows.hid_flat[index]


def _chains(blocks: _Blocks, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Chained hashes of every block, position-major, and where each position starts.

    `lengths` (blocks per request) must be sorted longest first, so the requests with a block
    at position i are the first `counts[i]`, stored at `offsets[i]:offsets[i] + counts[i]`
    in that order: block i's parent is at the same rank of position i-1. `_split` undoes it.
    """
    counts = np.searchsorted(-lengths, -np.arange(int(lengths[0]) if len(lengths) else 0), side="left")
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    hashes = np.empty(int(offsets[-1]), dtype=np.uint64)
    for i, count in enumerate(counts.tolist()):
        local = blocks.local(i, count)
        start = offsets[i]
        if i == 0:
            hashes[:count] = local
        else:
            previous = offsets[i - 1]
            hashes[start:start + count] = _xxh3_pair(hashes[previous:previous + count], local)
    return hashes, offsets


def _split(hashes: np.ndarray, offsets: np.ndarray, lengths: np.ndarray,
           chunk: int = 8192) -> list[tuple[int, ...]]:
    """Per-request tuples (in sorted order) from the position-major layout of `_chains`."""
    out: list[tuple[int, ...]] = []
    for lo in range(0, len(lengths), chunk):
        part = lengths[lo:lo + chunk]
        starts = np.concatenate([[0], np.cumsum(part)]).astype(np.int64)
        position = np.arange(starts[-1], dtype=np.int64) - np.repeat(starts[:-1], part)
        rank = np.repeat(np.arange(lo, lo + len(part), dtype=np.int64), part)
        values = hashes[offsets[position] + rank].tolist()
        out.extend(tuple(values[s:e]) for s, e in zip(starts[:-1].tolist(), starts[1:].tolist()))
    return out


def _build(rows: _Rows, row: np.ndarray, copy: np.ndarray, arrival: np.ndarray, block_size: int,
           tokens_per_hash_block: int) -> list[TraceRequest]:
    """The requests, already in arrival order: request i replays `row[i]` as copy `copy[i]`."""
    n = len(row)
    inputs = rows.input_tokens[row]
    lengths = inputs // block_size
    order = np.argsort(-lengths, kind="stable")
    pad = np.uint64(_MASK64) - np.arange(n, dtype=np.uint64)
    blocks = _Blocks(rows, row[order], copy[order].astype(np.uint64), pad[order], block_size,
                     tokens_per_hash_block)
    hashes, offsets = _chains(blocks, lengths[order])
    chains: list[tuple[int, ...]] = [()] * n
    for rank, chain in zip(order.tolist(), _split(hashes, offsets, lengths[order])):
        chains[rank] = chain
    outputs = rows.output_tokens[row]
    return [TraceRequest(f"r{i}", a, s, o, c) for i, (a, s, o, c) in enumerate(
        zip(arrival.tolist(), inputs.tolist(), outputs.tolist(), chains))]


# ---------------------------------------------------------------------------------------------
# Synthetic arrivals and lengths


# A process draws `count` arrival candidates after time t: (times, accepted mask, last candidate).
_Process = Callable[[np.random.Generator, float, int], tuple[np.ndarray, np.ndarray, float]]


def _process(kind: str, rate: float, cv: float, period_s: float, peak_to_trough: float) -> _Process:
    """The arrival process of `synthetic`'s `kind` (see its docstring)."""
    a = (peak_to_trough - 1.0) / (peak_to_trough + 1.0)
    peak = rate * (1.0 + a)

    def draw(rng: np.random.Generator, t: float, count: int) -> tuple[np.ndarray, np.ndarray, float]:
        if kind == "poisson":
            gaps = rng.exponential(1.0 / rate, count)
        elif kind == "gamma":
            gaps = rng.gamma(1.0 / cv**2, cv**2 / rate, count)
        else:
            gaps = rng.exponential(1.0 / peak, count)
        times = t + np.cumsum(gaps)
        if kind != "day":
            return times, np.ones(count, dtype=bool), float(times[-1])
        level = rate * (1.0 - a * np.cos(2.0 * np.pi * times / period_s))
        return times, rng.random(count) * peak < level, float(times[-1])
    return draw


def _arrival_times(draw: _Process, rng: np.random.Generator, duration_s: float | None,
                   num_requests: int | None) -> np.ndarray:
    """Arrivals until `duration_s` (exclusive) or the first `num_requests`, in chunks."""
    chunks, t, total = [], 0.0, 0
    while True:
        times, accepted, t = draw(rng, t, 4096)
        chunks.append(times[accepted])
        total += int(accepted.sum())
        if (num_requests is not None and total >= num_requests) or (
                duration_s is not None and t >= duration_s):
            break
    times = np.concatenate(chunks)
    return times[:num_requests] if num_requests is not None else times[times < duration_s]


def _lengths(rng: np.random.Generator, mean: int, sigma: float, n: int) -> np.ndarray:
    """`mean` exactly (sigma 0), or lognormal with that mean and log-space sigma, >= 1."""
    if sigma == 0:
        return np.full(n, mean, dtype=np.int64)
    draws = rng.lognormal(math.log(mean) - sigma**2 / 2.0, sigma, n)
    return np.maximum(1, np.rint(draws)).astype(np.int64)
