"""Parallel layouts checked against the model and the machine, each rank's shard ranges, and
the part of each checkpoint tensor a rank reads; the CLI's exit 2 naming the flag."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.helpers import make_engine
from tokenmill.engine.parallel.shard import LayoutError, ParallelLayout, shard_for
from tokenmill.engine.parallel.shard_weights import Part, local_name, source_index
from tokenmill.textgen.model_config import ModelConfig, load_model_config


@pytest.fixture()
def moe_cfg(tiny_moe: Path) -> ModelConfig:
    return load_model_config(tiny_moe)


def test_layouts_that_do_not_fit_name_their_flag(moe_cfg: ModelConfig) -> None:
    cfg = dataclasses.replace(moe_cfg, num_heads=6, num_kv_heads=2)
    cases = [
        (ParallelLayout(tp=4), cfg, "--tp: 6 attention heads do not divide into 4"),
        (ParallelLayout(tp=3), dataclasses.replace(cfg, num_heads=6, num_kv_heads=4), "--tp: 4 KV heads neither"),
        (ParallelLayout(ep=3), moe_cfg, f"--ep: {moe_cfg.moe.num_experts} experts do not divide into 3"),
        (ParallelLayout(tp=2, ep=4), moe_cfg, "--ep: with --tp 2 must be 1 or 2"),
        (ParallelLayout(tp=0), moe_cfg, "--tp: must be at least 1"),
        (ParallelLayout(ep=2), dataclasses.replace(moe_cfg, moe=None), "--ep: Qwen3MoeForCausalLM has no experts"),
        (ParallelLayout(tp=2), moe_cfg, "--tp: 2 ranks but only 1 cores"),
        (ParallelLayout(dp=2), moe_cfg, "--attention-dp: 2 needs --ep 2 and no --tp"),
        (ParallelLayout(tp=2, ep=2, dp=2), moe_cfg, "--attention-dp: 2 needs --ep 2 and no --tp"),
        (ParallelLayout(ep=2, dp=0), moe_cfg, "--attention-dp: must be at least 1"),
    ]
    for layout, model, message in cases:
        cores = 1 if "cores" in message else 64
        with pytest.raises(LayoutError, match=message):
            layout.validate(model, cores)
    ParallelLayout(tp=2, ep=2).validate(moe_cfg, 2)
    ParallelLayout(ep=2, dp=2).validate(moe_cfg, 2)


def test_shards_cover_heads_experts_and_replicate_kv_heads_when_fewer_than_ranks(moe_cfg: ModelConfig) -> None:
    cfg = dataclasses.replace(moe_cfg, num_heads=8, num_kv_heads=2, intermediate_size=64)
    shards = [shard_for(cfg, ParallelLayout(tp=4), r) for r in range(4)]
    assert [s.heads for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [s.kv_heads for s in shards] == [(0, 1), (0, 1), (1, 2), (1, 2)]  # heads 0-3 read KV head 0
    assert [s.intermediate for s in shards] == [(0, 16), (16, 32), (32, 48), (48, 64)]
    inter = cfg.moe.intermediate_size
    assert {s.experts for s in shards} == {(0, cfg.moe.num_experts)}  # TP: every expert, a slice of each
    assert shards[1].expert_intermediate == (inter // 4, inter // 2)
    ep = [shard_for(cfg, ParallelLayout(tp=2, ep=2), r) for r in range(2)]
    half = cfg.moe.num_experts // 2
    assert [s.experts for s in ep] == [(0, half), (half, 2 * half)]
    assert {s.expert_intermediate for s in ep} == {(0, inter)}
    local = ep[1].local_config(cfg)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4, 1, 32)


def test_a_rank_reads_only_its_slice_of_each_tensor(moe_cfg: ModelConfig) -> None:
    cfg, d = moe_cfg, moe_cfg.head_dim
    tp1 = shard_for(cfg, ParallelLayout(tp=2), 1)
    p = "model.layers.0."
    kv = cfg.num_kv_heads // 2
    assert source_index(tp1, cfg, p + "self_attn.q_proj.weight") == (slice(cfg.num_heads // 2 * d, cfg.num_heads * d),)
    assert source_index(tp1, cfg, p + "self_attn.k_proj.weight") == (slice(kv * d, 2 * kv * d),)
    assert source_index(tp1, cfg, p + "self_attn.o_proj.weight") == (slice(None), slice(cfg.num_heads // 2 * d,
                                                                                         cfg.num_heads * d))
    assert source_index(tp1, cfg, p + "self_attn.o_proj.bias") is Part.ZERO
    assert source_index(tp1, cfg, p + "self_attn.q_norm.weight") is None
    assert source_index(tp1, cfg, p + "mlp.gate.weight") is None  # the router: whole on every rank
    inter = cfg.moe.intermediate_size
    assert source_index(tp1, cfg, p + "mlp.experts.3.up_proj.weight") == (slice(inter // 2, inter),)
    assert source_index(tp1, cfg, p + "mlp.experts.3.down_proj.weight") == (slice(None), slice(inter // 2, inter))
    ep1 = shard_for(cfg, ParallelLayout(ep=2), 1)
    half = cfg.moe.num_experts // 2
    assert source_index(ep1, cfg, p + "mlp.experts.0.up_proj.weight") is Part.SKIP
    assert source_index(ep1, cfg, p + f"mlp.experts.{half}.up_proj.weight") is None
    assert source_index(ep1, cfg, p + "self_attn.q_proj.weight") is None  # EP alone: attention whole
    assert local_name(ep1, p + f"mlp.experts.{half + 1}.down_proj.weight") == p + "mlp.experts.1.down_proj.weight"
    assert source_index(tp1, cfg, "model.embed_tokens.weight") is None


@pytest.mark.parametrize(("flags", "message"), [
    (["--tp", "3"], "--tp:"),
    (["--tp", "0"], "--tp: must be at least 1"),
    (["--ep", "-1"], "--ep: must be at least 1"),
    (["--ep", "3"], "--ep:"),
    (["--tp", str((os.cpu_count() or 1) * 2)], "--tp:"),
    (["--tp", "2", "--runner", "mock"], "--tp: needs --runner torch"),
    (["--tp", "2", "--kv-host-gb", "1"], "--tp: KV tiers"),
    (["--tp", "2", "--prefill", "1", "--decode", "1"], "--tp: disaggregated serving"),
    (["--attention-dp", "2"], "--attention-dp: 2 needs --ep 2"),
    (["--attention-dp", "0"], "--attention-dp: must be at least 1"),
    (["--ep", "2", "--attention-dp", "2", "--kv-disk-dir", "kv-disk"], "--attention-dp: KV tiers"),
])
def test_serve_refuses_bad_parallel_flags_with_exit_2(tiny_moe: Path, flags: list[str], message: str) -> None:
    run = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_moe), *flags],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], run.stderr


def test_an_embedded_engine_refuses_a_layout_below_one(tiny_moe: Path) -> None:
    with pytest.raises(LayoutError, match="--ep: must be at least 1"):
        make_engine(tiny_moe, ep=0)
