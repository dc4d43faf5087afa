"""Reading trace files for the fleet simulator: Mooncake JSONL and Azure 2023 CSV records.

Every malformed record is one ValueError naming the file, the line and the field, e.g.
`trace.jsonl line 7: field "input_length" must be an integer >= 1`. Records come back raw, in
file order; `arrivals` fits them (time scale, caps) and builds the requests.
"""
from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path

_HASH_ID_LIMIT = 1 << 63
_AZURE_FIELDS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_TIME_RE = re.compile(r"\s*(\d{4})-(\d{1,2})-(\d{1,2})[ T](\d{1,2}):(\d{2}):(\d{2})(?:\.(\d+))?"
                      r"\s*(Z|[+-]\d{2}:?\d{2})?\s*$")
_TIME_EXAMPLE = "2023-11-16 18:15:46.6805900"


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


def read_mooncake(path: Path, max_requests: int | None) -> list[tuple[float, int, int, list[int]]]:
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


def read_azure(path: Path, max_requests: int | None) -> list[tuple[int, float, int, int]]:
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
