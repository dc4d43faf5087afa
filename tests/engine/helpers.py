"""Small helpers shared by the engine tests."""
from __future__ import annotations

from pathlib import Path

import torch

from tokenmill.engine.attention import AttentionBatch, SeqSpan
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.runner import TorchModelRunner
from tokenmill.textgen.model_config import MoEConfig
from tokenmill.textgen.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def seeded_moe(dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    """A 64-wide MoE layer (8 experts, top-2, 96 intermediate) with small seeded weights."""
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=96, norm_topk_prob=True,
                                  sparse_layers=frozenset({0})))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return moe.to(dtype)


def make_engine(model: Path, **overrides) -> LLMEngine:
    kwargs = dict(model=str(model), dtype="float32", num_kv_blocks=512, max_num_batched_tokens=256)
    kwargs.update(overrides)
    return LLMEngine(EngineConfig(**kwargs))


def prompt_logits(engine: LLMEngine, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of `tokens`, through the paged-KV forward pass."""
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    n, bs = len(tokens), engine.config.block_size
    blocks = torch.arange(-(-n // bs), dtype=torch.long)
    pos = torch.arange(n)
    batch = AttentionBatch(blocks[pos // bs] * bs + pos % bs, [SeqSpan(0, n, n, blocks)],
                           native_prefill=runner.native_prefill)
    return runner.forward(torch.tensor(tokens), pos, batch, pos)


def prompts(engine: LLMEngine, count: int, seed: int = 0, low: int = 5, high: int = 120) -> list[list[int]]:
    """Deterministic prompts of mixed length made of ordinary (non-special) tokens."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (count,), generator=g).tolist()
    vocab = engine.model_config.vocab_size
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def outputs_around_doubling_down(moe: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MoE layer's output on x, then again after its down projections double in place (a
    reload writing into the parameters): packed copies must follow."""
    with torch.inference_mode():
        before = moe(x)
    with torch.no_grad():
        moe.w_down.mul_(2)
    with torch.inference_mode():
        return before, moe(x)
