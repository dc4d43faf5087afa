"""`tokenmill bench engine --profile`: where a decode step and a prefill chunk spend their time.

After the measured run (so its figures carry no profiling cost), the first `PROFILE_REQUESTS`
requests of the workload run again with their prompts reversed (the same lengths and tokens, but
no prefix the cache holds from the measured run), outputs capped at `PROFILE_MAX_OUTPUT` tokens,
with `engine.step_profile.StepProfiler` attached: exclusive milliseconds per operator class per
step, for decode-only steps and for steps that compute prompt tokens. The hooks add a few
microseconds per module call, so the sum is slightly above the unprofiled step time.

Then a new turn on a long cached context: `LONG_CONTEXT` prompt tokens are cached by a first
request, and a second sends them plus `NEW_TURN` new tokens; its prefill is timed, with the
attention FLOPs it computes (QK^T and PV over the cached and new keys) per second of attention.
"""
from __future__ import annotations

from typing import Any

PROFILE_REQUESTS = 16
PROFILE_MAX_OUTPUT = 64
LONG_CONTEXT, NEW_TURN = 3000, 168


def profile_engine(engine: Any, prompts: list[list[int]], output_lens: list[int]) -> dict[str, Any]:
    """{kind: {"steps": n, "ms": {class: mean ms per step}}} for kind in decode, prefill."""
    from tokenmill.engine.step_profile import StepProfiler
    from tokenmill.textgen.sampling import SamplingParams

    params = [SamplingParams(max_tokens=min(n, PROFILE_MAX_OUTPUT), temperature=0.0, ignore_eos=True)
              for n in output_lens[:PROFILE_REQUESTS]]
    with StepProfiler(engine) as profiler:
        for i, (prompt, p) in enumerate(zip(prompts[:PROFILE_REQUESTS], params)):
            engine.add_request(f"profile-{i}", prompt[::-1], p)
        while engine.has_unfinished():
            engine.step()
    profile: dict[str, Any] = {kind: {"steps": part.steps, "ms": part.mean_ms()}
                               for kind, part in profiler.breakdown.items()}
    if engine.max_model_len > LONG_CONTEXT + NEW_TURN:
        profile["long_context_prefill"] = _new_turn_on_long_context(engine, prompts)
    return profile


def _new_turn_on_long_context(engine: Any, prompts: list[list[int]]) -> dict[str, float]:
    from tokenmill.engine.step_profile import StepProfiler
    from tokenmill.textgen.sampling import SamplingParams

    tokens = [t for p in prompts for t in p[::-1]]
    context, turn = tokens[:LONG_CONTEXT], tokens[LONG_CONTEXT:LONG_CONTEXT + NEW_TURN]
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.generate([context], one)
    with StepProfiler(engine) as profiler:
        engine.generate([context + turn], one)
    part = profiler.breakdown["prefill"]
    cfg = engine.model_config
    keys = NEW_TURN * LONG_CONTEXT + NEW_TURN * (NEW_TURN + 1) / 2  # each new token's keys, causal
    flops = 4 * keys * cfg.num_heads * cfg.head_dim * cfg.num_layers
    attention_s = part.seconds["attention"]
    return {"context_tokens": LONG_CONTEXT, "new_tokens": NEW_TURN, "steps": part.steps,
            "prefill_ms": sum(part.seconds.values()) * 1e3, "attention_ms": attention_s * 1e3,
            "attention_gflops": flops / max(attention_s, 1e-9) / 1e9}


def render_profile(profile: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="where a step's time goes (exclusive ms per step, share of the step)")
    table.add_column("operator class")
    kinds = [kind for kind in ("decode", "prefill") if profile[kind]["steps"]]
    for kind in kinds:
        table.add_column(f"{kind} ({profile[kind]['steps']} steps)", justify="right")
    totals = {kind: sum(profile[kind]["ms"].values()) for kind in kinds}
    for cls in profile["decode"]["ms"]:
        table.add_row(cls, *(f"{profile[k]['ms'][cls]:.2f} ({profile[k]['ms'][cls] / max(totals[k], 1e-9):.0%})"
                             for k in kinds))
    table.add_row("step", *(f"{totals[k]:.2f}" for k in kinds))
    Console().print(table)
    long = profile.get("long_context_prefill")
    if long is not None:
        Console().print(f"new turn of {long['new_tokens']} tokens on {long['context_tokens']} cached: prefill "
                        f"{long['prefill_ms']:.1f} ms, of which attention {long['attention_ms']:.1f} ms "
                        f"({long['attention_gflops']:.1f} GFLOP/s)")
