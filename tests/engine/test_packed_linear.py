"""bf16 expert GEMMs against weights packed once for oneDNN: same numbers as `F.linear`.
(The native grouped-expert kernel: test_grouped_experts.py.)"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.engine.helpers import outputs_around_doubling_down, seeded_moe
from tokenmill.engine.kernels.packed_linear import PackedLinear, bf16_packing_available, pack_experts
from tokenmill.engine.models import moe as layers
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.weights import prepack_weights

# Packing runs only where oneDNN has native bf16 (AVX-512 BF16 or AMX). Elsewhere each test checks
# the other half of the contract: nothing is packed and the layer keeps its other paths.
PACKING = bf16_packing_available()


@pytest.fixture(autouse=True)
def _without_the_native_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about the oneDNN path: keep the grouped-expert kernel (tested in
    test_grouped_experts.py) out of the way."""
    monkeypatch.setattr(layers.grouped_experts, "available", lambda dtype: False)


def _moe(seed: int = 0) -> SparseMoE:
    return seeded_moe(torch.bfloat16, seed)


@pytest.mark.parametrize("rows", [1, 3, 18, 100])
def test_packed_linear_is_bit_identical_to_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
    if PACKING:
        assert torch.equal(PackedLinear(w)(x), F.linear(x, w))
    else:
        assert pack_experts(w.unsqueeze(0)) is None


def test_packing_refuses_what_it_cannot_run() -> None:
    assert pack_experts(torch.zeros(2, 4, 4)) is None  # fp32: F.linear needs no packing
    with pytest.raises(ValueError):
        PackedLinear(torch.zeros(4, 4))


def test_moe_packed_experts_match_the_plain_path(monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _moe()
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    with torch.inference_mode():
        packed = moe(x)
        assert (moe._packed is not None) == PACKING
        monkeypatch.setattr(layers, "bf16_packing_available", lambda: False)
        plain = moe(x)
    assert torch.equal(packed, plain)


def test_moe_repacks_after_weights_change_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reload that writes into the parameters must not leave stale packed copies in use."""
    moe = _moe()
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before, after = outputs_around_doubling_down(moe, x)
    monkeypatch.setattr(layers, "bf16_packing_available", lambda: False)
    with torch.inference_mode():
        plain = moe(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, plain)


def test_training_mode_keeps_autograd() -> None:
    moe = _moe()
    x = torch.randn(5, 64).to(torch.bfloat16)
    moe(x).float().sum().backward()  # the packed op has no backward: grad-enabled calls must not use it
    assert moe.w_gate_up.grad is not None and moe._packed is None


def test_prepack_packs_before_the_first_forward() -> None:
    """Packing happens at load, not inside the first request's latency."""
    moe = _moe()
    prepack_weights(torch.nn.Sequential(moe))
    if PACKING:
        assert moe._packed is not None and len(moe._packed[0]) == 8
    else:
        assert moe._packed is None
