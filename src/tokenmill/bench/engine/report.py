"""Results of `tokenmill bench engine`: the JSON schema, the decode-step floor, the table.

JSON written by `--json OUT` (schema_version 1; times in seconds unless the key says ms):

    {
      "schema_version": 1,
      "config": {model, num_requests, min_prompt, max_prompt, min_output, max_output, seed,
                 dtype, threads, max_num_seqs, max_num_batched_tokens, hf_batch_size,
                 skip_hf, hf_max_requests, json_path},
      "workload": {num_requests, prompt_source, arrival ("all at t=0"),
                   prompt_tokens, prompt_len_min, prompt_len_mean, prompt_len_max,
                   output_tokens, output_len_min, output_len_mean, output_len_max},
      "tokenmill": {output_tokens_per_s   (output tokens / wall_s),
                    wall_s                (add_request of all requests to the last step),
                    mean_step_ms          (forward-pass time per step, from engine stats),
                    mean_decode_step_ms   (the same over steps that computed no prefill),
                    mean_wall_step_ms     (wall_s / steps: includes scheduling and bookkeeping),
                    steps, decode_only_steps, preemptions, output_tokens, prefill_tokens,
                    kv_blocks             (the engine's KV pool: $TOKENMILL_KV_CACHE_GB can size it)},
      "hf": null (--skip-hf) or
            {useful_output_tokens_per_s (each request's own requested tokens / wall_s),
             requests_run (the first N requests, whole batches), requests_total,
             wall_s, batch_size, num_batches,
             useful_output_tokens, generated_tokens (rows x new tokens, padding rows included),
             mean_step_ms (wall_s / generate steps, prefill included)},
      "ratio": tokenmill.output_tokens_per_s / hf.useful_output_tokens_per_s, or null,
      "floor": null (no decode-only step) or
               {bandwidth_gbps (best single copy, read+write bytes / s, at --threads),
                decode_batch_mean, context_tokens_mean (per decode-only step, summed over seqs),
                weight_bytes_per_decode_step, kv_bytes_per_decode_step,
                bytes_per_decode_step, floor_ms, mean_decode_step_ms, decode_step_over_floor,
                matmul_gflops (best in-cache 512^3 matmul at --threads, the faster of fp32 and
                the model's dtype), flops_per_decode_step, compute_floor_ms,
                decode_step_over_compute_floor, phase_floor_ms, decode_step_over_phase_floor}
    }

The floor of a decode step is the bytes it must read once: every non-expert weight
(attention, router, norms, lm_head), the embedding rows it gathers, for MoE layers the
experts a batch of B tokens is expected to touch, E·(1-(1-k/E)^B), and the K/V of every
sequence's context; divided by the measured bandwidth. It is averaged over the
decode-only steps actually run, so it matches `mean_decode_step_ms`.

Beside it, the compute floor: the step's FLOPs (every matmul of the batch's tokens, each token
through its top-k experts, the LM head, and attention's QK^T and PV over each context) at the
best matmul rate measured here. A CPU whose vectors widen bf16 to fp32 (no AVX-512 BF16 or
AMX) can sit above the memory floor on arithmetic alone at a large batch; the step can be
no faster than the larger of the two floors.

And the phase floor: a layer's matmuls and its attention run one after the other, each bound by
its own resource, so at a large batch the matmuls are compute-bound while attention reads the
KV, and neither hides the other. Each phase's larger floor, summed: max(weights / bandwidth,
matmul FLOPs / rate) + max(KV / bandwidth, attention FLOPs / rate), averaged over the steps
(a step is compute- or memory-bound by its own batch). It is at least the larger of the two
floors above and at most their sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.bench.engine.hf_baseline import HFResult
from tokenmill.textgen.model_config import ModelConfig

SCHEMA_VERSION = 1


@dataclass(slots=True)
class WorkloadSummary:
    num_requests: int
    prompt_source: str
    arrival: str
    prompt_tokens: int
    prompt_len_min: int
    prompt_len_mean: float
    prompt_len_max: int
    output_tokens: int
    output_len_min: int
    output_len_mean: float
    output_len_max: int


@dataclass(slots=True)
class TokenmillResult:
    output_tokens_per_s: float
    wall_s: float
    mean_step_ms: float
    mean_decode_step_ms: float
    mean_wall_step_ms: float
    steps: int
    decode_only_steps: int
    preemptions: int
    output_tokens: int
    prefill_tokens: int
    decode_s: float = 0.0  # in decode-only steps
    decode_collective_s: float = 0.0  # of that, rank 0 in collectives (a parallel engine)
    kv_blocks: int = 0  # the engine's KV pool, which preemptions depend on


@dataclass(slots=True)
class DecodeStepShape:
    """One decode-only step: how many sequences, and their summed context lengths."""
    batch: int
    context_tokens: int


@dataclass(slots=True)
class FloorResult:
    bandwidth_gbps: float
    decode_batch_mean: float
    context_tokens_mean: float
    weight_bytes_per_decode_step: float
    kv_bytes_per_decode_step: float
    bytes_per_decode_step: float
    floor_ms: float
    mean_decode_step_ms: float
    decode_step_over_floor: float
    matmul_gflops: float
    flops_per_decode_step: float
    compute_floor_ms: float
    decode_step_over_compute_floor: float
    phase_floor_ms: float
    decode_step_over_phase_floor: float


@dataclass(slots=True)
class EngineBenchReport:
    config: dict[str, Any]
    workload: WorkloadSummary
    tokenmill: TokenmillResult
    hf: HFResult | None
    ratio: float | None
    floor: FloorResult | None
    profile: dict[str, Any] | None = None  # --profile: {decode|prefill: {steps, ms: {class: ms/step}}}
    # --tp/--ep/--attention-dp: {"tp", "ep", "attention_dp", "collective_s": rank 0's seconds in
    # collectives, "collective_share": of the run, "decode_collective_share": of decode-only steps}
    parallel: dict[str, Any] | None = None
    # the simulator's decode step for this layout on cpu-local: {"layout", "decode_step_ms",
    # "communication_ms", "note"} (the ms are None without a `sim calibrate` here)
    predicted: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema_version": SCHEMA_VERSION, **asdict(self)}


def expected_experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Distinct experts hit by `batch` tokens each picking `top_k` of `num_experts` uniformly."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def decode_weight_bytes(cfg: ModelConfig, batch: int, itemsize: int) -> float:
    """Weight bytes one decode step over `batch` sequences must read (biases ignored)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = h * (q + 2 * kv) + q * h + (2 * cfg.head_dim if cfg.qk_norm else 0)
    per_layer_fixed = attention + 2 * h  # + the two RMSNorms
    params = 0.0
    for layer in range(cfg.num_layers):
        params += per_layer_fixed
        if cfg.moe is not None and layer in cfg.moe.sparse_layers:
            moe = cfg.moe
            touched = expected_experts_touched(moe.num_experts, moe.top_k, batch)
            params += moe.num_experts * h + touched * 3 * h * moe.intermediate_size
        else:
            params += 3 * h * cfg.intermediate_size
    params += h + cfg.vocab_size * h + batch * h  # final norm, lm_head, gathered embedding rows
    return params * itemsize


def decode_flops(cfg: ModelConfig, batch: float, context_tokens: float) -> float:
    """FLOPs of one decode step over `batch` sequences whose contexts sum to `context_tokens`."""
    return decode_matmul_flops(cfg, batch) + decode_attention_flops(cfg, context_tokens)


def decode_matmul_flops(cfg: ModelConfig, batch: float) -> float:
    """Every matmul of `batch` tokens: projections, MLP or each token's top-k experts, LM head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    macs_per_token = 0.0
    for layer in range(cfg.num_layers):
        macs_per_token += h * (q + 2 * kv) + q * h
        if cfg.moe is not None and layer in cfg.moe.sparse_layers:
            moe = cfg.moe
            macs_per_token += moe.num_experts * h + moe.top_k * 3 * h * moe.intermediate_size
        else:
            macs_per_token += 3 * h * cfg.intermediate_size
    macs_per_token += cfg.vocab_size * h
    return 2 * batch * macs_per_token


def decode_attention_flops(cfg: ModelConfig, context_tokens: float) -> float:
    """QK^T and PV over contexts summing to `context_tokens`: a multiply-add per key or value,
    query head and dim, per layer."""
    return 2 * 2 * context_tokens * cfg.num_heads * cfg.head_dim * cfg.num_layers


def kv_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


def decode_floor(cfg: ModelConfig, itemsize: int, shapes: list[DecodeStepShape],
                 bandwidth_gbps: float, matmul_gflops: float, mean_decode_step_ms: float) -> FloorResult | None:
    if not shapes:
        return None
    n = len(shapes)
    weights = sum(decode_weight_bytes(cfg, s.batch, itemsize) for s in shapes) / n
    batch_mean = sum(s.batch for s in shapes) / n
    context_mean = sum(s.context_tokens for s in shapes) / n
    kv = context_mean * kv_bytes_per_token(cfg, itemsize)
    floor_ms = (weights + kv) / (bandwidth_gbps * 1e9) * 1e3
    flops = decode_flops(cfg, batch_mean, context_mean)  # linear in both: the steps' mean FLOPs
    compute_floor_ms = flops / (matmul_gflops * 1e9) * 1e3
    phase_floor_ms = sum(_phase_floor_s(cfg, itemsize, s, bandwidth_gbps * 1e9, matmul_gflops * 1e9)
                         for s in shapes) / n * 1e3
    return FloorResult(
        bandwidth_gbps=bandwidth_gbps, decode_batch_mean=batch_mean,
        context_tokens_mean=context_mean, weight_bytes_per_decode_step=weights,
        kv_bytes_per_decode_step=kv, bytes_per_decode_step=weights + kv, floor_ms=floor_ms,
        mean_decode_step_ms=mean_decode_step_ms, decode_step_over_floor=mean_decode_step_ms / floor_ms,
        matmul_gflops=matmul_gflops, flops_per_decode_step=flops, compute_floor_ms=compute_floor_ms,
        decode_step_over_compute_floor=mean_decode_step_ms / compute_floor_ms,
        phase_floor_ms=phase_floor_ms, decode_step_over_phase_floor=mean_decode_step_ms / phase_floor_ms,
    )


def _phase_floor_s(cfg: ModelConfig, itemsize: int, step: DecodeStepShape, bandwidth: float, rate: float) -> float:
    """One step's matmuls, then its attention, each at the slower of its reads and its FLOPs."""
    matmuls = max(decode_weight_bytes(cfg, step.batch, itemsize) / bandwidth, decode_matmul_flops(cfg, step.batch) / rate)
    kv = step.context_tokens * kv_bytes_per_token(cfg, itemsize)
    return matmuls + max(kv / bandwidth, decode_attention_flops(cfg, step.context_tokens) / rate)


def render_table(report: EngineBenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmill bench engine — {report.config['model']}")
    table.add_column("figure")
    table.add_column("value", justify="right")
    for label, value in _table_rows(report):
        table.add_row(label, value)
    Console().print(table)


def _table_rows(r: EngineBenchReport) -> list[tuple[str, str]]:
    w, t = r.workload, r.tokenmill
    rows = [
        ("workload", f"{w.num_requests} req, prompts {w.prompt_len_min}-{w.prompt_len_max} "
                     f"({w.prompt_tokens} tok), outputs {w.output_len_min}-{w.output_len_max} "
                     f"({w.output_tokens} tok)"),
        ("tokenmill output tok/s", f"{t.output_tokens_per_s:.1f}"),
        ("tokenmill wall", f"{t.wall_s:.2f} s, {t.steps} steps, {t.preemptions} preemptions "
                           f"(a pool of {t.kv_blocks} KV blocks)"),
        ("tokenmill mean step", f"{t.mean_step_ms:.1f} ms (wall/step {t.mean_wall_step_ms:.1f} ms)"),
        ("tokenmill mean decode-only step", f"{t.mean_decode_step_ms:.1f} ms over {t.decode_only_steps}"),
    ]
    if r.hf is not None:
        h = r.hf
        rows += [
            ("transformers useful tok/s", f"{h.useful_output_tokens_per_s:.1f}"),
            ("transformers run", f"{h.requests_run}/{h.requests_total} req, batch {h.batch_size}, "
                                 f"{h.wall_s:.1f} s, {h.mean_step_ms:.1f} ms/step"),
            ("ratio tokenmill / transformers", f"{r.ratio:.2f}x"),
        ]
    if r.floor is not None:
        f = r.floor
        rows += [
            ("memory bandwidth (copy)", f"{f.bandwidth_gbps:.1f} GB/s"),
            ("decode batch / context (mean)", f"{f.decode_batch_mean:.1f} seqs / {f.context_tokens_mean:.0f} tok"),
            ("bytes per decode step", f"{f.weight_bytes_per_decode_step / 1e6:.1f} MB weights + "
                                      f"{f.kv_bytes_per_decode_step / 1e6:.1f} MB KV"),
            ("decode step vs floor", f"{f.mean_decode_step_ms:.2f} ms vs {f.floor_ms:.2f} ms "
                                     f"({f.decode_step_over_floor:.1f}x)"),
            ("decode step vs compute floor", f"{f.mean_decode_step_ms:.2f} ms vs {f.compute_floor_ms:.2f} ms "
                                             f"({f.decode_step_over_compute_floor:.1f}x): "
                                             f"{f.flops_per_decode_step / 1e9:.2f} GFLOP at "
                                             f"{f.matmul_gflops:.0f} GFLOP/s"),
            ("decode step vs phase floor", f"{f.mean_decode_step_ms:.2f} ms vs {f.phase_floor_ms:.2f} ms "
                                           f"({f.decode_step_over_phase_floor:.1f}x): matmuls, then attention"),
        ]
    return rows + _parallel_rows(r)


def _parallel_rows(r: EngineBenchReport) -> list[tuple[str, str]]:
    """A parallel run's time in collectives, and the simulator's decode step beside the measured."""
    rows = []
    if r.parallel is not None:
        p = r.parallel
        layout = f"tp {p['tp']} / ep {p['ep']}"
        if p["attention_dp"] > 1:
            layout += f" / attention-dp {p['attention_dp']}"
        rows.append((f"{layout}: rank 0 in collectives",
                     f"{p['collective_s']:.2f} s ({p['collective_share']:.0%} of the run, "
                     f"{p['decode_collective_share']:.0%} of decode steps)"))
    if r.predicted is not None and r.floor is not None:
        pr = r.predicted
        value = pr["note"] if pr["decode_step_ms"] is None else (
            f"{pr['decode_step_ms']:.2f} ms ({pr['communication_ms']:.2f} ms communication) vs "
            f"{r.floor.mean_decode_step_ms:.2f} ms measured")
        rows.append((f"simulator, cpu-local {pr['layout']}: decode step".replace("  ", " "), value))
    return rows
