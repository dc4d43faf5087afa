"""Per-serving-framework knobs of the step-time model, fitted on the silicon data's training split.

The GPU catalog holds hardware numbers; these hold what the software adds on top: per-step CPU
overhead, how close its kernels get to the hardware curves, and how its scheduler batches prefill.
`data/fitted.json` is written by `tokenmill sim validate --refit` (training rows only).

A framework's first-token path also differs by model (DeepSeek's first token takes ~150 ms more than
gpt-oss's at concurrency 4 on every framework measured), so the fit stores, per framework and model
with enough aggregated training rows, its own values of the TTFT-only fields (`TTFT_FIELDS`), keyed
"backend/model"; they replace the framework's values for that model in aggregated serving and leave every
TPOT term alone.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

FITTED_FILE = "data/fitted.json"
DEFAULT_BACKEND = "trtllm"  # whose fit is stored as `default` (estimate/search without --backend)
# Fields that only enter time-to-first-token (the first-token path and how waiting prompts queue).
TTFT_FIELDS = ("ttft_overhead_s", "ttft_steps", "wave_fraction")


@dataclass(slots=True, frozen=True)
class Tuning:
    step_overhead_s: float = 1.0e-3  # scheduler + launch time per engine step (assumption before fit)
    seq_overhead_s: float = 10e-6  # host work per running sequence per step: sampling, stop checks, detokenize (prior)
    compute_scale: float = 1.0  # multiplies GEMM and attention efficiency in decode steps
    # Prefill runs different kernels (large-M GEMMs, FlashAttention forward, chunked-prefill scheduling),
    # so its achieved fraction of the curves is fitted on its own (TTFT), not borrowed from decode (TPOT).
    prefill_compute_scale: float = 1.0
    # Grouped MoE GEMMs (per-expert row blocks, token permute/unpermute) relative to a dense GEMM's curve.
    moe_compute_scale: float = 1.0
    mem_scale: float = 1.0  # multiplies achievable HBM bandwidth
    latency_scale: float = 1.0  # multiplies kernel and collective fixed latencies
    moe_imbalance: float = 1.3  # hottest rank's expert load over the mean when EP > 1 (assumption)
    wave_fraction: float = 0.5  # share of concurrent requests whose prefills queue behind each other
    max_prefill_tokens: int = 8192  # per-step token budget for prefill (chunked prefill)
    ttft_overhead_s: float = 0.02  # HTTP, tokenisation, scheduling before the first forward pass
    # Engine iterations (at the running batch's step time) between arrival and the first streamed token
    # besides the request's own prefill: waiting for the step in flight to admit it, the output path
    # running one overlapped step behind, the stream interval. A count, so it scales with step time.
    ttft_steps: float = 0.0
    prefill_in_tpot: float = 1.0  # share of the interleaved prefill work that shows up in measured TPOT
    # Engine cap on sequences decoded per step per attention-DP rank (CUDA-graph batch, scheduler slots).
    # 384: TensorRT-LLM's DeepSeek-R1 FP4 max-throughput recipe on 8xB200 (--max_batch_size 384 with
    # attention DP, concurrency 3072), "How to get best performance on DeepSeek-R1 in TensorRT-LLM".
    max_batch_per_rank: int = 384
    # Attention-DP balance (TensorRT-LLM tech blog 10, `attention_dp_config.enable_balance`, off by
    # default): context requests are held until every rank has one, so mixed steps cost the mean
    # rank's prefill instead of the busiest rank's, and TTFT pays the wait.
    adp_balance: bool = False

    def __post_init__(self) -> None:
        for name in ("compute_scale", "prefill_compute_scale", "moe_compute_scale", "mem_scale", "latency_scale", "moe_imbalance"):
            if getattr(self, name) <= 0:
                raise ValueError(f"tuning: field {name} must be > 0")
        for name in ("step_overhead_s", "seq_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"tuning: field {name} must be >= 0")
        for name in ("wave_fraction", "prefill_in_tpot"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"tuning: field {name} must be in [0, 1]")
        for name in ("ttft_overhead_s", "ttft_steps"):
            if getattr(self, name) < 0:
                raise ValueError(f"tuning: field {name} must be >= 0")
        for name in ("max_prefill_tokens", "max_batch_per_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"tuning: field {name} must be >= 1")

    def replace(self, **changes: float | bool) -> "Tuning":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, float | bool]:
        return dataclasses.asdict(self)


def load_fitted(path: Path | None = None) -> dict[str, Tuning]:
    """Backend name -> fitted Tuning, plus "backend/model" -> that Tuning with the model's TTFT fields.

    Empty when no fit has been stored.
    """
    if path is not None:
        text = Path(path).read_text() if Path(path).exists() else "{}"
    else:
        res = resources.files("tokenmill.sim").joinpath(FITTED_FILE)
        text = res.read_text() if res.is_file() else "{}"
    raw = json.loads(text)
    table = {k: Tuning(**v) for k, v in raw.get("backends", {}).items()}
    for key, fields in raw.get("models", {}).items():
        backend = key.partition("/")[0]
        if backend in table:
            table[key] = table[backend].replace(**{f: fields[f] for f in TTFT_FIELDS if f in fields})
    return table


def model_key(backend: str, model: str) -> str:
    return f"{backend}/{model}"


def pick_tuning(table: dict[str, Tuning], backend: str | None, model: str | None = None) -> Tuning:
    """The most specific fit: backend and model, then backend, then `default`, then the priors.

    No backend means DEFAULT_BACKEND, the framework the `default` fit is a copy of.
    """
    backend = backend or DEFAULT_BACKEND
    if model and model_key(backend, model) in table:
        return table[model_key(backend, model)]
    if backend in table:
        return table[backend]
    return table.get("default", Tuning())


def tuning_for(backend: str | None = None, model: str | None = None, fitted: dict[str, Tuning] | None = None) -> Tuning:
    """The fitted tuning of a backend (and model, where the fit has one), falling back as `pick_tuning` does."""
    return pick_tuning(load_fitted() if fitted is None else fitted, backend, model)
