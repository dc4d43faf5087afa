"""Rows of the measured-deployments CSV, mapped onto the simulator's inputs.

Coverage rules (each excluded row gets a reason):
- the model must be in the catalog (Qwen3.5's hybrid linear attention and GLM-5 are not modelled);
- disaggregated rows must say how many prefill and decode workers ran (otherwise per-worker load is unknown);
- the row needs a concurrency (`silicon_concurrency=` in its source, or batch_size for aggregated rows).

Aggregated rows whose concurrency exceeds the configured batch (29 rows, all TensorRT-LLM) are kept:
their TTFT shows no admission queue while TPOT grows ~concurrency/batch, so `serving.aggregated`
models them as resident requests taking turns in the engine's decode slots. Disaggregated rows
without worker counts are not inferred: nothing else in the row (no GPU total, no per-worker batch)
pins how the concurrency splits over decode workers, and TPOT depends on exactly that split.
"""
from __future__ import annotations

import csv
import re
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tokenmill.sim.hardware import GPU_ALIASES
from tokenmill.sim.models import MODEL_ALIASES

CONCURRENCY_RE = re.compile(r"silicon_concurrency=(\d+)")
HELD_OUT_BUCKETS = 5  # of 10: crc32(id) % 10 >= 5 -> held out (a deterministic 50/50 split)


@dataclass(slots=True, frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int


@dataclass(slots=True, frozen=True)
class SiliconRow:
    row_id: str
    backend: str
    model: str  # catalog name
    gpu: str  # catalog name
    precision: str
    mode: str  # agg | disagg
    isl: int
    osl: int
    concurrency: int
    batch: int  # agg: max requests in flight the engine was configured for (batch_size x attention-DP)
    agg: Layout | None
    prefill: Layout | None
    decode: Layout | None
    prefill_workers: int
    decode_workers: int
    prefill_batch: int
    ttft_ms: float
    tpot_ms: float

    @property
    def held_out(self) -> bool:
        return zlib.crc32(self.row_id.encode()) % 10 >= HELD_OUT_BUCKETS


def _int(raw: str, default: int = 1) -> int:
    value = int(float(raw)) if raw not in ("", None) else default
    return value if value > 0 else default


def _layout(r: dict[str, str], prefix: str) -> Layout:
    return Layout(tp=_int(r[f"{prefix}tp_size"]), pp=_int(r[f"{prefix}pp_size"]),
                  dp=_int(r[f"{prefix}attention_dp_size"]), ep=_int(r[f"{prefix}moe_ep_size"]))


def _precision(r: dict[str, str]) -> str:
    return r["moe_quant_mode"] or r["gemm_quant_mode"] or r["precision"] or "bf16"


def parse_row(r: dict[str, str]) -> SiliconRow | str:
    """A SiliconRow, or the reason the row is not covered."""
    model = MODEL_ALIASES.get(r["model_path"].lower())
    if model is None:
        return f"model {r['model_path']} not in catalog"
    match = CONCURRENCY_RE.search(r["silicon_data_source"])
    disagg = r["mode"] == "disagg"
    if disagg and not (r["prefill_num_workers"] and r["decode_num_workers"]):
        return "disagg row without worker counts"
    concurrency = int(match.group(1)) if match else (_int(r["batch_size"], 0) if not disagg else 0)
    if concurrency <= 0:
        return "no concurrency"
    return SiliconRow(
        row_id=r["id"], backend=r["backend"], model=model, gpu=GPU_ALIASES.get(r["system"], r["system"]),
        precision=_precision(r), mode=r["mode"], isl=int(r["isl"]), osl=int(r["osl"]), concurrency=concurrency,
        batch=_int(r["batch_size"], concurrency) * (1 if disagg else _int(r["attention_dp_size"])), agg=None if disagg else _layout(r, ""),
        prefill=_layout(r, "prefill_") if disagg else None, decode=_layout(r, "decode_") if disagg else None,
        prefill_workers=_int(r["prefill_num_workers"]), decode_workers=_int(r["decode_num_workers"]),
        prefill_batch=_int(r["prefill_batch_size"]), ttft_ms=float(r["silicon_ttft_ms"]), tpot_ms=float(r["silicon_tpot_ms"]),
    )


@dataclass(slots=True, frozen=True)
class SiliconSet:
    rows: list[SiliconRow]
    excluded: Counter  # reason -> count
    total: int


def load_silicon(path: Path) -> SiliconSet:
    rows: list[SiliconRow] = []
    excluded: Counter = Counter()
    with open(path, newline="") as fh:
        raw_rows = list(csv.DictReader(fh))
    for raw in raw_rows:
        parsed = parse_row(raw)
        if isinstance(parsed, str):
            excluded[parsed] += 1
        else:
            rows.append(parsed)
    return SiliconSet(rows=rows, excluded=excluded, total=len(raw_rows))
