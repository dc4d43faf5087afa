"""The stack-overhead benchmark: the same seeded workload through `tokenmill bench engine`
(in-process) and through `tokenmill serve` (HTTP), and the ratio of their output tokens/s.

`--engine-workload MODEL_DIR` makes `tokenmill bench serve` send exactly the requests of
`tokenmill bench engine --model MODEL_DIR` (its `make_workload`, same seed and length
flags: --min-input/--max-input are its --min-prompt/--max-prompt); `--compare-engine
ENGINE_JSON` reads that benchmark's JSON, checks the workloads match, and reports
serve ÷ engine. Run the engine side first with the server stopped, so they never share CPUs:

    tokenmill bench engine --model M --skip-hf --threads 1 --max-num-seqs 32 --json engine.json
    tokenmill serve --model M --threads 1 --max-num-seqs 32 --port 8000 &
    tokenmill bench serve --url http://127.0.0.1:8000 --model NAME --concurrency 32 \\
        --engine-workload M --compare-engine engine.json

The frontend's own latency per token needs a known engine step: serve with the mock runner at
a fixed step (`--runner mock --mock-step-time 0.02,0,0,0`) and add `--mock-step-ms 20
--mock-reference`: the same workload first runs in-process through the mock engine (same
step, max_num_seqs = --concurrency, engine defaults otherwise, as the server must be), and
its wall time per step, i.e. the step plus the engine loop's bookkeeping, is the baseline
that each request's TPOT is compared with; the throughput ratio is against it too.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenmill.bench.harness.serve_report import EngineComparison
from tokenmill.workloads.prompt_synth import RequestSpec

# engine-bench config key → the bench-serve flag that must carry the same value
MATCHED_FLAGS = {"num_requests": "num_requests", "min_prompt": "min_input", "max_prompt": "max_input",
                 "min_output": "min_output", "max_output": "max_output", "seed": "seed"}


def engine_workload_specs(model_dir: str, lengths: dict[str, int]) -> list[RequestSpec]:
    """`tokenmill bench engine`'s requests for this model; `lengths` holds MATCHED_FLAGS' values."""
    from tokenmill.bench.engine.engine_bench import EngineBenchConfig, make_workload
    from tokenmill.textgen.model_config import load_model_config
    from tokenmill.textgen.tokenizer import Tokenizer

    cfg = EngineBenchConfig(model=model_dir, skip_hf=True,
                            **{key: lengths[flag] for key, flag in MATCHED_FLAGS.items()})
    vocab_size = load_model_config(model_dir).vocab_size
    workload = make_workload(cfg, vocab_size, Tokenizer(model_dir).special_token_ids)
    return [RequestSpec(prompt, out) for prompt, out in zip(workload.prompts, workload.output_lens)]


def engine_tokens_per_s(engine_json: str, lengths: dict[str, int]) -> float:
    """The engine's output tokens/s; ValueError naming the flag when the file is unreadable or
    ran another workload (checked before the run, so a mismatch wastes no time)."""
    try:
        report: dict[str, Any] = json.loads(Path(engine_json).read_text(encoding="utf-8"))
        engine_cfg = report["config"]
        engine_tps = float(report["tokenmill"]["output_tokens_per_s"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--compare-engine {engine_json}: not a `tokenmill bench engine` JSON ({exc})") from exc
    for key, flag in MATCHED_FLAGS.items():
        if engine_cfg.get(key) != lengths[flag]:
            raise ValueError(f"--compare-engine {engine_json}: its {key} is {engine_cfg.get(key)}, but "
                             f"--{flag.replace('_', '-')} is {lengths[flag]}; run both on the same workload")
    if engine_tps <= 0:
        raise ValueError(f"--compare-engine {engine_json}: output_tokens_per_s is {engine_tps}")
    return engine_tps


def mock_engine_reference(model_dir: str, specs: list[RequestSpec], step_ms: float,
                          max_num_seqs: int) -> tuple[float, float]:
    """(output tokens/s, wall ms per step) of the in-process mock engine on these requests."""
    from tokenmill.bench.engine.engine_bench import Workload, run_tokenmill
    from tokenmill.engine.config import EngineConfig
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.engine.mock_runner import StepTimeModel

    engine = LLMEngine(EngineConfig(model=model_dir, threads=1, max_num_seqs=max_num_seqs, runner="mock",
                                    mock_step_time=StepTimeModel(step_ms / 1e3, 0.0, 0.0, 0.0)))
    result, _ = run_tokenmill(engine, Workload([s.prompt for s in specs], [s.output_len for s in specs]))
    return result.output_tokens_per_s, result.mean_wall_step_ms


def compare(engine_json: str, engine_tps: float, serve_tps: float) -> EngineComparison:
    return EngineComparison(engine_json, engine_tps, serve_tps, serve_tps / engine_tps)
