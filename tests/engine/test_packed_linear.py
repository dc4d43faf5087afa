"""bf16 expert GEMMs against weights packed once for oneDNN: same numbers as `F.linear`."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.engine.kernels.packed_linear import PackedLinear, bf16_packing_available, pack_experts
from tokenmill.engine.models import layers
from tokenmill.engine.models.layers import SparseMoE
from tokenmill.textgen.model_config import MoEConfig

needs_packing = pytest.mark.skipif(not bf16_packing_available(), reason="no oneDNN bf16 weight packing here")


def _moe(seed: int = 0) -> SparseMoE:
    g = torch.Generator().manual_seed(seed)
    moe = SparseMoE(64, MoEConfig(num_experts=8, top_k=2, intermediate_size=96, norm_topk_prob=True,
                                  sparse_layers=frozenset({0})))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return moe.to(torch.bfloat16)


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 18, 100])
def test_packed_linear_is_bit_identical_to_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    assert torch.equal(PackedLinear(w)(x), F.linear(x, w))


def test_packing_refuses_what_it_cannot_run() -> None:
    assert pack_experts(torch.zeros(2, 4, 4)) is None  # fp32: F.linear needs no packing
    with pytest.raises(ValueError):
        PackedLinear(torch.zeros(4, 4))


@needs_packing
def test_moe_packed_experts_match_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        packed = moe(x)
        assert moe._packed is not None
        monkeypatch.setattr(layers, "bf16_packing_available", lambda: False)
        plain = moe(x)
    assert torch.equal(packed, plain)


@needs_packing
def test_moe_repacks_after_weights_change_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that writes into the parameters must not leave stale packed copies in use."""
    moe = _moe()
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with torch.inference_mode():
        before = moe(x)
    with torch.no_grad():
        moe.w_down.mul_(2)
    with torch.inference_mode():
        after = moe(x)
        monkeypatch.setattr(layers, "bf16_packing_available", lambda: False)
        plain = moe(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, plain)


def test_training_mode_keeps_autograd() -> None:
    moe = _moe()
    x = torch.randn(5, 64).to(torch.bfloat16)
    moe(x).float().sum().backward()  # the packed op has no backward: grad-enabled calls must not use it
    assert moe.w_gate_up.grad is not None and moe._packed is None


@needs_packing
def test_prepack_packs_before_the_first_forward() -> None:
    """Packing happens at load, not inside the first request's latency."""
    moe = _moe()
    layers.prepack_experts(torch.nn.Sequential(moe))
    assert moe._packed is not None and len(moe._packed[0]) == 8
