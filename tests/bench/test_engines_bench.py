"""`tokenmill bench engines` without servers: its flag checks, the sides it would start, the order
it runs them in, and the figures and ratios it reports, on synthetic client records."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from tokenmill.bench.engines import engines_bench
from tokenmill.bench.engines.engines_report import Goal, comparison_report, complete, run_outcome
from tokenmill.bench.engines.engines_sides import SERVE, VLLM_ALONE, EnginesConfig
from tokenmill.bench.harness.loadgen import OK, TIMEOUT, RequestRecord
from tokenmill.cli import main
from tokenmill.workloads.prompt_synth import SyntheticShape, corpus_requests


def _args(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engines_bench.add_arguments(parser)
    return parser.parse_args(list(flags))


def _config(model: Path, *flags: str) -> EnginesConfig:
    return engines_bench.resolve(_args("--quick", "--model", str(model), "--engine-python", sys.executable, *flags))


@pytest.mark.parametrize(("flags", "named"), [
    (["--compare", "foo"], "--compare"),
    (["--compare", "layer,layer"], "--compare"),
    (["--requests", "0"], "--requests"),
    (["--repeats", "-1"], "--repeats"),
    (["--pool-fraction", "0"], "--pool-fraction"),
    (["--min-input", "500", "--max-input", "100"], "--max-input"),
    (["--max-model-len", "512"], "--max-model-len"),
    (["--threads", "100000"], "--threads"),
    (["--engine-python", "/nonexistent/python"], "make install-vllm"),
    (["--dtype", "float16"], "--dtype float16"),
])
def test_bad_flags_exit_2_naming_the_flag(flags: list[str], named: str, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["bench", "engines", *flags]) == 2
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and named in errors[0] and "\n" not in errors[0]


def test_a_model_without_config_is_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    assert main(["bench", "engines", "--model", str(tmp_path), "--engine-python", sys.executable]) == 2
    assert "--model" in caplog.text


def test_quick_sizes_and_given_flags_win(tiny_dense: Path) -> None:
    cfg = _config(tiny_dense, "--requests", "5")
    assert (cfg.requests, cfg.concurrency, cfg.shape.max_output) == (5, 2, 16)
    assert cfg.compare == ("layer", "routing", "engines")
    full = engines_bench.resolve(_args("--model", str(tiny_dense), "--engine-python", sys.executable))
    assert (full.requests, full.concurrency, full.shape.min_input, full.shape.max_input, full.shape.max_output) == (
        48, 16, 300, 1000, 128)


def test_sides_follow_the_contract(tiny_dense: Path) -> None:
    layer, routing, engines = engines_bench.build_comparisons(_config(tiny_dense, "--threads", "1"))
    ours, alone = layer.sides
    assert ours.kind == SERVE and alone.kind == VLLM_ALONE
    assert {"--engine", "vllm", "--engine-python", sys.executable}.issubset(ours.flags)
    assert alone.command().startswith(f"{sys.executable} -m vllm.entrypoints.openai.api_server --model ")
    assert "--enforce-eager" in alone.flags and alone.env["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    assert [s.name for s in routing.sides] == ["kv", "round-robin"]
    assert all(s.workers == 2 and s.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" for s in routing.sides)
    context = routing.workload["max_model_len"]
    longest = max(len(s.prompt) + s.output_len for s in [*routing.specs, *routing.warmup])
    assert longest < context and routing.workload["kv_cache_blocks_per_worker"] * 32 >= context
    own, vllm = engines.sides
    assert "--engine" not in own.flags and own.flags[own.flags.index("--threads") + 1] == "1"
    # both comparisons on prose send the very same prompts, none shared with a warm-up
    assert [s.prompt for s in layer.specs] == [s.prompt for s in engines.specs]
    starts = {tuple(s.prompt[:8]) for s in layer.specs} | {tuple(s.prompt[:8]) for s in layer.warmup}
    assert len(starts) == len(layer.specs) + len(layer.warmup)


def test_every_side_runs_at_the_one_dtype(tiny_dense: Path) -> None:
    for dtype in ("float32", "bfloat16"):
        flags = ("--dtype", dtype) if dtype != "float32" else ()  # float32 unless told
        layer, _, engines = engines_bench.build_comparisons(_config(tiny_dense, "--threads", "1", *flags))
        (ours, alone), (own, vllm) = layer.sides, engines.sides
        other = "bfloat16" if dtype == "float32" else "float32"
        for side in (ours, vllm):
            assert f"dtype={dtype}" in side.flags and f"dtype={other}" not in side.flags
        for side in (alone, own):
            assert side.flags[side.flags.index("--dtype") + 1] == dtype


def test_corpus_requests_are_seeded_slices_in_range() -> None:
    corpus = list(range(10_000))
    shape = SyntheticShape(20, 40, 5, 5)
    specs = corpus_requests(corpus, 50, shape, seed=3)
    assert [s.prompt for s in specs] == [s.prompt for s in corpus_requests(corpus, 50, shape, seed=3)]
    assert all(20 <= len(s.prompt) <= 40 and s.output_len == 5 for s in specs)
    assert all(s.prompt == list(range(s.prompt[0], s.prompt[0] + len(s.prompt))) for s in specs)
    assert len({s.prompt[0] for s in specs}) == 50
    with pytest.raises(ValueError, match="--max-input"):
        corpus_requests(corpus[:60], 50, shape, seed=3)


def _record(i: int, start_s: float, ttft_s: float, gap_s: float, tokens: int = 4) -> RequestRecord:
    times = [ttft_s + k * gap_s for k in range(tokens)]
    return RequestRecord(i, 10, tokens, status=OK, start_s=start_s, ttft_s=ttft_s, e2e_s=times[-1],
                         token_times_s=times, prompt_tokens=10, completion_tokens=tokens)


def test_figures_ratios_and_targets() -> None:
    # side a: two requests over 1.0 s (8 tokens); side b: the same in 2.0 s, TTFTs twice as long
    a = [_record(0, 0.0, 0.1, 0.1), _record(1, 0.3, 0.3, 0.2)]  # ends 0.4 and 0.9 + 0.3 = 1.2 -> 1.2 s
    b = [_record(0, 0.0, 0.2, 0.2), _record(1, 0.6, 0.6, 0.4)]  # ends 0.8 and 1.8 + 0.6 = 2.4 -> 2.4 s
    runs = [run_outcome("a", 0, 0, a), run_outcome("b", 0, 1, b)]
    goals = (Goal("output_tok_s", "a", "b", ">=", 1.9), Goal("ttft_ms_mean", "a", "b", "<=", 0.4))
    report = comparison_report("x", {"a": {}, "b": {}}, runs, goals, {"description": "d"}, None)
    sa, sb = report["sides"]["a"], report["sides"]["b"]
    assert sa["output_tok_s"] == pytest.approx(8 / 1.2) and sb["output_tok_s"] == pytest.approx(8 / 2.4)
    assert sa["ttft_ms_mean"] == pytest.approx(200.0) and sb["ttft_ms_p50"] == pytest.approx(400.0)
    assert sa["itl_ms_p50"] == pytest.approx(150.0)  # gaps 100 x3 and 200 x3
    assert report["ratio_of"] == ["a", "b"]
    assert report["ratios"]["output_tok_s"] == pytest.approx(2.0)
    assert report["ratios"]["ttft_ms_p99"] == pytest.approx(0.5)
    met = [t["met"] for t in report["targets"]]
    assert met == [True, False] and report["targets"][1]["value"] == pytest.approx(0.5)
    assert complete(report)
    b[1].status = TIMEOUT
    failed = comparison_report("x", {"a": {}, "b": {}}, [runs[0], run_outcome("b", 0, 1, b)], goals, {}, None)
    assert not complete(failed) and failed["sides"]["b"]["requests_ok"] == 1


def test_sides_alternate_and_a_failed_server_ends_only_its_comparison(tiny_dense: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = _config(tiny_dense, "--compare", "layer", "--repeats", "3")
    comparison = engines_bench.build_comparisons(cfg)[0]
    order: list[tuple[str, int]] = []

    def fake_run_side(comp, side, repeat, cfg, work_dir):  # noqa: ANN001, ANN202
        order.append((side.name, repeat))
        if len(order) == 5:
            raise RuntimeError("tokenmill serve exited with 1 before it was healthy")
        return [_record(0, 0.0, 0.1, 0.1)]

    monkeypatch.setattr(engines_bench, "run_side", fake_run_side)
    report = engines_bench.run_comparison(comparison, cfg, tmp_path)
    a, b = SERVE, VLLM_ALONE
    assert order == [(a, 0), (b, 0), (b, 1), (a, 1), (a, 2)]
    assert [(r["side"], r["position"]) for r in report["runs"]] == [(a, 0), (b, 1), (b, 0), (a, 1)]
    assert report["error"].startswith("tokenmill serve exited") and not complete(report)
    assert report["sides"][a]["runs"] == 2 and report["sides"][b]["runs"] == 2
