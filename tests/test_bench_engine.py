"""`tokenmill bench engine` on a tiny model with a tiny workload: schema, counts, errors.

No assertions on speed: only that the figures exist, are positive and add up.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tokenmill.bench.engine.engine_bench import EngineBenchConfig, make_workload, run_engine_bench
from tokenmill.bench.engine.report import (
    decode_attention_flops,
    decode_flops,
    decode_matmul_flops,
    decode_weight_bytes,
    expected_experts_touched,
)
from tokenmill.bench.harness.report_file import write_json
from tokenmill.cli import main
from tokenmill.engine.config import EngineConfig
from tokenmill.textgen.model_config import load_model_config

TOP_KEYS = {"schema_version", "config", "workload", "tokenmill", "hf", "ratio", "floor"}
TOKENMILL_KEYS = {"output_tokens_per_s", "wall_s", "mean_step_ms", "mean_decode_step_ms", "steps",
                  "preemptions", "output_tokens", "kv_blocks"}
HF_KEYS = {"useful_output_tokens_per_s", "requests_run", "wall_s", "batch_size", "useful_output_tokens"}
FLOOR_KEYS = {"bandwidth_gbps", "decode_batch_mean", "bytes_per_decode_step", "floor_ms",
              "decode_step_over_floor", "matmul_gflops", "flops_per_decode_step", "compute_floor_ms",
              "decode_step_over_compute_floor", "phase_floor_ms", "decode_step_over_phase_floor"}


def tiny_config(model: Path, json_path: Path, **overrides: object) -> EngineBenchConfig:
    fields = dict(model=str(model), json_path=str(json_path), num_requests=6, min_prompt=4,
                  max_prompt=24, min_output=2, max_output=8, dtype="float32", hf_batch_size=2,
                  hf_max_requests=2)
    fields.update(overrides)
    return EngineBenchConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def bench_json(tiny_moe: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "engine.json"
    write_json(run_engine_bench(tiny_config(tiny_moe, out)).to_json(), out)
    return json.loads(out.read_text())


def test_json_has_the_schema_keys(bench_json: dict) -> None:
    assert TOP_KEYS <= bench_json.keys()
    assert TOKENMILL_KEYS <= bench_json["tokenmill"].keys()
    assert HF_KEYS <= bench_json["hf"].keys()
    assert FLOOR_KEYS <= bench_json["floor"].keys()


def test_the_report_names_the_pool_the_default_sizing_gave(bench_json: dict, tiny_moe: Path) -> None:
    config = EngineConfig(model=str(tiny_moe), dtype="float32")  # as the bench's, sized by no flag
    assert bench_json["tokenmill"]["kv_blocks"] == config.kv_blocks(load_model_config(tiny_moe))


def test_figures_are_positive(bench_json: dict) -> None:
    for section, keys in (("tokenmill", TOKENMILL_KEYS - {"preemptions"}), ("hf", HF_KEYS),
                          ("floor", FLOOR_KEYS)):
        for key in keys:
            assert bench_json[section][key] > 0, f"{section}.{key}"
    assert bench_json["ratio"] > 0


def test_the_phase_floor_lies_between_the_larger_floor_and_their_sum(bench_json: dict) -> None:
    f = bench_json["floor"]
    assert max(f["floor_ms"], f["compute_floor_ms"]) <= f["phase_floor_ms"] * (1 + 1e-9)
    assert f["phase_floor_ms"] <= (f["floor_ms"] + f["compute_floor_ms"]) * (1 + 1e-9)
    assert f["decode_step_over_phase_floor"] == pytest.approx(f["mean_decode_step_ms"] / f["phase_floor_ms"])


def test_output_tokens_equal_the_requested_totals(bench_json: dict, tiny_moe: Path) -> None:
    cfg = tiny_config(tiny_moe, Path("unused.json"))
    workload = make_workload(cfg, load_model_config(tiny_moe).vocab_size, frozenset())
    assert bench_json["tokenmill"]["output_tokens"] == bench_json["workload"]["output_tokens"]
    assert bench_json["workload"]["output_tokens"] == sum(workload.output_lens)
    hf = bench_json["hf"]
    assert hf["requests_run"] == 2 and hf["requests_total"] == 6
    assert hf["useful_output_tokens"] == sum(workload.output_lens[:2])
    assert hf["generated_tokens"] >= hf["useful_output_tokens"]


def test_profile_splits_decode_and_prefill_steps_by_operator_class(tiny_moe: Path, tmp_path: Path) -> None:
    report = run_engine_bench(tiny_config(tiny_moe, tmp_path / "p.json", skip_hf=True, profile=True))
    profile = report.profile
    assert profile is not None and profile["decode"]["steps"] > 0 and profile["prefill"]["steps"] > 0
    for kind in ("decode", "prefill"):
        ms = profile[kind]["ms"]
        assert {"attention", "experts", "dense", "sampling", "scheduling", "engine"} <= ms.keys()
        assert all(v >= 0 for v in ms.values())
        assert ms["experts"] > 0 and ms["attention"] > 0 and ms["dense"] > 0 and ms["sampling"] > 0
    assert report.to_json()["profile"] == profile


def test_a_tensor_parallel_run_reports_its_time_in_collectives(tiny_moe: Path, tmp_path: Path) -> None:
    report = run_engine_bench(tiny_config(tiny_moe, tmp_path / "tp.json", skip_hf=True, tp=2, threads=2))
    assert report.parallel is not None and (report.parallel["tp"], report.parallel["ep"]) == (2, 1)
    assert report.parallel["collective_s"] > 0 and 0 < report.parallel["collective_share"] < 1
    assert 0 < report.parallel["decode_collective_share"] < 1
    assert report.tokenmill.output_tokens == report.workload.output_tokens
    assert report.config["tp"] == 2


def test_an_attention_dp_run_finishes_every_request_and_reports_its_exchanges(tiny_moe: Path, tmp_path: Path) -> None:
    report = run_engine_bench(tiny_config(tiny_moe, tmp_path / "dp.json", skip_hf=True, ep=2, attention_dp=2,
                                          threads=2))
    assert report.parallel is not None and report.parallel["attention_dp"] == 2
    assert 0 < report.parallel["decode_collective_share"] < 1
    assert report.tokenmill.output_tokens == report.workload.output_tokens


def test_workload_is_seeded_and_in_range(tiny_moe: Path) -> None:
    cfg = tiny_config(tiny_moe, Path("unused.json"))
    a = make_workload(cfg, 512, frozenset({0, 1, 2}))
    assert a == make_workload(cfg, 512, frozenset({0, 1, 2}))
    assert all(4 <= len(p) <= 24 for p in a.prompts) and all(2 <= n <= 8 for n in a.output_lens)
    assert not {0, 1, 2} & {t for p in a.prompts for t in p}


def test_expert_bytes_grow_with_batch_up_to_all_experts(tiny_moe: Path) -> None:
    assert expected_experts_touched(16, 2, 1) == pytest.approx(2.0)
    assert expected_experts_touched(16, 2, 1000) == pytest.approx(16.0)
    cfg = load_model_config(tiny_moe)
    assert decode_weight_bytes(cfg, 1, 4) < decode_weight_bytes(cfg, 64, 4)


def test_decode_flops_agree_with_the_weights_one_token_reads(tiny_moe: Path) -> None:
    """One token with no context does a multiply-add per weight it reads (its top-k experts, as
    the weight count has for a batch of one), bar the norms and its embedding row; each key and
    value of a context costs a multiply-add per query head and dim, per layer."""
    cfg = load_model_config(tiny_moe)
    norms = cfg.num_layers * (2 * cfg.hidden_size + (2 * cfg.head_dim if cfg.qk_norm else 0)) + cfg.hidden_size
    matmul_params = decode_weight_bytes(cfg, 1, 1) - norms - cfg.hidden_size  # less the embedding row
    assert decode_flops(cfg, 1, 0) == pytest.approx(2 * matmul_params)
    assert decode_flops(cfg, 3, 0) == pytest.approx(3 * decode_flops(cfg, 1, 0))
    per_context_token = 2 * 2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    assert decode_flops(cfg, 1, 100) - decode_flops(cfg, 1, 0) == pytest.approx(100 * per_context_token)
    assert decode_flops(cfg, 3, 100) == pytest.approx(decode_matmul_flops(cfg, 3) + decode_attention_flops(cfg, 100))


def test_cli_bad_model_exits_nonzero_naming_the_field(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        rc = main(["bench", "engine", "--model", str(tmp_path / "missing"), "--json", str(tmp_path / "o.json")])
    assert rc != 0
    assert "--model" in caplog.text and "config.json" in caplog.text
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("overrides, field", [
    ({"min_prompt": 30, "max_prompt": 10}, "--max-prompt"),
    ({"num_requests": 0}, "--num-requests"),
    ({"hf_max_requests": 0}, "--hf-max-requests"),
    ({"dtype": "int8"}, "--dtype"),
])
def test_bad_config_names_the_field(tiny_moe: Path, overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        tiny_config(tiny_moe, Path("unused.json"), **overrides)


def test_workload_longer_than_the_context_is_refused(tiny_moe: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--max-prompt"):
        run_engine_bench(tiny_config(tiny_moe, tmp_path / "o.json", min_prompt=8, max_prompt=4000,
                                     min_output=8, max_output=4000, skip_hf=True))


def test_the_deterministic_comparison_runs_both_sides_on_the_same_workloads(tiny_moe: Path, tmp_path: Path) -> None:
    out = tmp_path / "det.json"
    assert main(["bench", "engine", "--deterministic", "--model", str(tiny_moe), "--json", str(out),
                 "--num-requests", "4", "--min-prompt", "4", "--max-prompt", "24", "--min-output", "2", "--max-output", "6",
                 "--dtype", "float32", "--rounds", "2", "--kv-cache-gb", "0.01"]) == 0
    report = json.loads(out.read_text())
    runs = report["runs"]
    assert [(r["round"], r["side"]) for r in runs] == [(0, "default"), (0, "deterministic"),
                                                       (1, "deterministic"), (1, "default")]
    for i in (0, 1):  # each round's workload, the same on both sides
        assert len({r["output_tokens"] for r in runs if r["round"] == i}) == 1
    assert report["output_tokens_per_s_ratio"] > 0 and report["decode_step_ratio"] > 0
    assert main(["bench", "engine", "--deterministic", "--model", str(tiny_moe), "--json", str(out),
                 "--rounds", "0"]) == 2
