"""Decode steps through CUDA graphs' static buffers, checked here without a GPU: the same padded
step run op by op (`run_eagerly`) against the unpadded one, and the row-form attention the graphs
capture against PyTorch's attention over each row's gathered keys."""
from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine import decode_graphs
from tokenmill.engine.attention import batched_decode_attention
from tokenmill.engine.cli_args import add_engine_arguments, engine_argv, engine_config_from_args
from tokenmill.engine.decode_graphs import GraphShapes, graph_shapes, run_eagerly
from tokenmill.engine.runner import StepPart, TorchModelRunner
from tokenmill.engine.speculative import SpeculativeConfig
from tokenmill.textgen.model_config import MoEConfig


@settings(max_examples=30, deadline=None)
@given(kv_heads=st.integers(1, 3), group=st.integers(1, 4), bs=st.sampled_from([4, 16]),
       lens=st.lists(st.integers(1, 70), min_size=1, max_size=5), extra=st.integers(0, 3), seed=st.integers(0, 999))
def test_row_attention_matches_sdpa_over_each_rows_keys(kv_heads: int, group: int, bs: int, lens: list[int],
                                                        extra: int, seed: int) -> None:
    """Tables wider than any row needs (`extra` blocks of padding, as a graph's bucket is)."""
    g = torch.Generator().manual_seed(seed)
    dim, num_blocks = 32, 80
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g)
    width = max(-(-n // bs) for n in lens) + extra
    table = torch.randint(0, num_blocks, (len(lens), width), generator=g)
    q = torch.randn(len(lens), kv_heads * group, dim, generator=g)
    out = batched_decode_attention(q, cache[0], cache[1], table, torch.tensor(lens), dim ** -0.5)
    for i, n in enumerate(lens):
        ctx = cache.index_select(1, table[i]).reshape(2, -1, kv_heads, dim)[:, :n].transpose(1, 2)
        ref = F.scaled_dot_product_attention(q[i][None, :, None], ctx[0][None], ctx[1][None], enable_gqa=True)
        assert torch.allclose(out[i], ref[0, :, 0], atol=1e-5)


def test_buckets_pad_batches_as_vllm_does_and_widths_by_powers_of_two() -> None:
    assert GraphShapes(64, 20).batch_buckets() == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert GraphShapes(12, 8).batch_buckets() == [1, 2, 4, 8, 12]
    assert GraphShapes(1, 3).batch_buckets() == [1]
    assert GraphShapes(8, 20).width_buckets() == [8, 16, 20]
    assert GraphShapes(8, 64).width_buckets() == [8, 16, 32, 64]
    assert GraphShapes(8, 3).width_buckets() == [3]


def test_graphs_are_captured_on_a_gpu_only_for_models_that_never_wait_on_the_host() -> None:
    def config(**kw):
        base = dict(device="cuda", enforce_eager=False, max_num_seqs=48, max_num_batched_tokens=2048,
                    speculative=None, block_size=16)
        return SimpleNamespace(**{**base, **kw})
    dense = SimpleNamespace(moe=None)
    assert graph_shapes(config(), dense, 1000) == GraphShapes(48, 63)
    assert graph_shapes(config(speculative=SpeculativeConfig(num_tokens=4)), dense, 1000) == GraphShapes(240, 63)
    assert graph_shapes(config(max_num_batched_tokens=32), dense, 1000).max_batch == 32
    assert graph_shapes(config(device="cpu"), dense, 1000) is None
    assert graph_shapes(config(enforce_eager=True), dense, 1000) is None
    moe = SimpleNamespace(moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=96, norm_topk_prob=True,
                                        sparse_layers=frozenset({0})))
    assert graph_shapes(config(), moe, 1000) is None


def test_enforce_eager_reaches_the_config_and_the_worker_flags() -> None:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--model", "m", "--enforce-eager"])
    assert engine_config_from_args(args).enforce_eager
    assert "--enforce-eager" in engine_argv(args)
    assert not engine_config_from_args(parser.parse_args(["--model", "m"])).enforce_eager


def _runner(engine, graphs: GraphShapes | None) -> TorchModelRunner:
    cfg, num_blocks = engine.model_config, engine.config.num_kv_blocks
    runner = TorchModelRunner(engine.runner.model, cfg, num_blocks, engine.config.block_size, torch.float32,
                              graphs=graphs)
    runner.row_decode, runner.native_decode = True, False  # the row form, as on a GPU
    return runner


def test_a_padded_step_gives_the_unpadded_logits_and_writes_no_other_block(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense, num_kv_blocks=64)
    graphed = _runner(engine, GraphShapes(8, 8, run_eagerly))
    eager = _runner(engine, None)
    g = torch.Generator().manual_seed(3)
    for runner in (graphed, eager):  # the same random context in both pools
        runner.kv_cache[:, :, :64].copy_(torch.randn(runner.kv_cache[:, :, :64].shape, generator=g.manual_seed(3)))
    bs = engine.config.block_size
    lens = [5, 40, 17]  # three sequences decoding, the second with two drafts as well
    parts = [StepPart([7 + i], n - 1, np.arange(i * 4, i * 4 + -(-n // bs)), True, 1) for i, n in enumerate(lens)]
    parts[1] = StepPart([9, 10, 11], lens[1] - 1, np.arange(4, 4 + -(-(lens[1] + 2) // bs)), True, 3)
    before = graphed.kv_cache.clone()
    step = graphed.step_inputs(parts)
    got = graphed.graphs.run(*step)
    want = eager.forward(*eager.step_inputs(parts))
    assert got is not None and got.shape == want.shape == (5, engine.model_config.vocab_size)
    assert graphed.graphs.steps.keys() == {(8, 8)} and graphed.graphs.replayed == 1
    assert got.data_ptr() == graphed.graphs.logits.data_ptr()  # the one logits buffer, outside the graphs' pool
    assert torch.allclose(got, want, atol=1e-4)
    written = set(step[2].slot_mapping.tolist())
    flat = lambda kv: kv.flatten(2, 3).transpose(0, 2)  # noqa: E731  [slots, 2, layers, ...]
    changed = (flat(graphed.kv_cache) != flat(before)).flatten(1).any(1).nonzero().flatten().tolist()
    scratch = range(64 * bs, 65 * bs)
    assert {s for s in changed if s not in scratch} <= written and any(s in scratch for s in changed)
    assert torch.allclose(graphed.kv_cache[:, :, :64], eager.kv_cache[:, :, :64], atol=1e-5)


def test_a_prompt_chunk_or_a_step_past_the_largest_bucket_runs_op_by_op(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense, num_kv_blocks=64)
    runner = _runner(engine, GraphShapes(2, 4, run_eagerly))
    bs = engine.config.block_size
    chunk = [StepPart(list(range(3, 20)), 0, np.arange(2), False, 1)]
    three = [StepPart([5], 10, np.arange(i, i + 1), True, 1) for i in range(3)]
    wide = [StepPart([5], 5 * bs, np.arange(6), True, 1)]
    for parts in (chunk, three, wide):
        assert runner.graphs.run(*runner.step_inputs(parts)) is None
    assert not runner.graphs.steps


@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_an_engine_on_graphs_generates_the_greedy_text_of_the_native_kernels(tiny_dense: Path, monkeypatch,
                                                                             speculative: str | None) -> None:
    spec = SpeculativeConfig.parse(speculative, None)
    reference = make_engine(tiny_dense, max_num_seqs=6, speculative=spec)
    monkeypatch.setattr(decode_graphs, "graph_shapes",
                        lambda config, model, max_len: GraphShapes(8, -(-max_len // config.block_size), run_eagerly))
    graphed = make_engine(tiny_dense, max_num_seqs=6, speculative=spec)
    runner = graphed.runner
    assert runner.graphs is not None and runner.row_decode and not runner.native_decode
    batch = prompts(reference, 6, seed=5)
    batch[0] = batch[0][:8] * 6  # a repeating prompt: prompt lookup finds drafts in it
    assert graphed.generate(batch, GREEDY) == reference.generate(batch, GREEDY)
    assert runner.graphs.replayed > 0
    if spec is not None:
        assert graphed.stats().spec_draft_tokens > 0


def test_a_bucket_whose_capture_fails_runs_op_by_op(tiny_dense: Path) -> None:
    def out_of_memory(step):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory (a test's)")
    engine = make_engine(tiny_dense, num_kv_blocks=64)
    runner = _runner(engine, GraphShapes(4, 8, out_of_memory))
    parts = [StepPart([5], 10, np.arange(i, i + 1), True, 1) for i in range(3)]
    assert runner.graphs.run(*runner.step_inputs(parts)) is None
    assert runner.graphs.run(*runner.step_inputs(parts)) is None and runner.graphs.steps == {(4, 8): None}
