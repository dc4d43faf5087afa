"""The native small-M kernels (`kernels/grouped_experts.c`) against PyTorch on the same numbers:
random shapes, ragged and empty experts, bf16 and fp32; and the MoE layer's native path against
its per-expert PyTorch path."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.engine.helpers import outputs_around_doubling_down, seeded_moe
from tokenmill.engine.kernels import grouped_experts
from tokenmill.engine.models.moe import SparseMoE
from tokenmill.engine.models.native_linear import NativeLinear

DTYPES = [torch.float32, torch.bfloat16]


def _reference_moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                   w2: torch.Tensor) -> torch.Tensor:
    """The layer's function in fp64 on the same (rounded) inputs, one assignment at a time."""
    inter = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = w13[e].double() @ x[t].double()
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double() @ hidden)
    return out


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().amax()) if got.numel() else 0.0


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 20), top_k=st.integers(1, 3), experts=st.integers(3, 9),
       hidden=st.integers(1, 40), inter=st.integers(1, 40), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_moe_kernel_matches_the_reference(tokens: int, top_k: int, experts: int, hidden: int, inter: int,
                                          dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g).to(dtype)
    w2 = torch.randn(experts, hidden, inter, generator=g).to(dtype)
    # ragged, and the last two experts get no token at all
    ids = torch.randint(0, experts - 2, (tokens, top_k), generator=g)
    weights = torch.rand(tokens, top_k, generator=g)
    got = grouped_experts.moe_experts(x, ids, weights, grouped_experts.pack_panels(w13),
                                      grouped_experts.pack_panels(w2), inter)
    want = _reference_moe(x, ids, weights, w13, w2)
    assert got.dtype == torch.float32 and got.shape == (tokens, hidden)
    assert _max_error(got, want) <= 1e-5 * max(_max_error(want, 0 * want), 1.0) * (hidden + inter)


def test_moe_kernel_silu_holds_at_extreme_gates() -> None:
    """Gates far past exp's range on both sides, and near 0, through the vector SiLU: with x = e_0,
    up = 1 and down = I, the layer's output is silu(gate) itself."""
    gates = torch.tensor([-400.0, -100.0, -88.5, -20.0, -1.0, -1e-3, 0.0, 1e-3,
                          0.5, 2.0, 20.0, 87.0, 88.5, 100.0, 400.0, -0.75, 3.0])
    inter = hidden = len(gates)
    w13 = torch.zeros(1, 2 * inter, hidden)
    w13[0, :inter, 0] = gates
    w13[0, inter:, 0] = 1.0
    w2 = torch.eye(hidden).unsqueeze(0)
    x = torch.zeros(1, hidden)
    x[0, 0] = 1.0
    got = grouped_experts.moe_experts(x, torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1),
                                      grouped_experts.pack_panels(w13), grouped_experts.pack_panels(w2), inter)
    want = F.silu(gates.double())
    assert torch.allclose(got[0].double(), want, rtol=1e-6, atol=1e-30)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 20), k=st.integers(1, 70), out=st.integers(1, 70), dtype=st.sampled_from(DTYPES),
       seed=st.integers(0, 2**16))
def test_linear_kernel_matches_matmul(rows: int, k: int, out: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, k, generator=g).to(dtype)
    x = torch.randn(rows, k, generator=g)
    got = grouped_experts.linear(x, grouped_experts.pack_panels(w), out)
    want = x.double() @ w.double().T
    assert got.shape == (rows, out)
    assert _max_error(got, want) <= 1e-5 * k


def test_panels_interleave_sixteen_rows_and_pad_with_zeros() -> None:
    w = torch.arange(18 * 3, dtype=torch.float32).view(18, 3)
    panels = grouped_experts.pack_panels(w)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, :, 5], w[5]) and torch.equal(panels[1, :, 1], w[17])
    assert not panels[1, :, 2:].any()


def test_bad_expert_ids_and_shapes_are_refused() -> None:
    w13, w2 = grouped_experts.pack_panels(torch.ones(2, 8, 4)), grouped_experts.pack_panels(torch.ones(2, 4, 4))
    with pytest.raises(ValueError, match="expert ids"):
        grouped_experts.moe_experts(torch.ones(1, 4), torch.tensor([[2]]), torch.ones(1, 1), w13, w2, 4)
    with pytest.raises(ValueError, match="expert ids"):
        grouped_experts.moe_experts(torch.ones(1, 4), torch.tensor([[-2]]), torch.ones(1, 1), w13, w2, 4)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_experts.moe_experts(torch.ones(1, 5), torch.tensor([[1]]), torch.ones(1, 1), w13, w2, 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_assignments_to_another_ranks_experts_are_skipped(dtype: torch.dtype) -> None:
    """Id -1 (an expert another rank holds) adds nothing: the same as that assignment with weight 0."""
    g = torch.Generator().manual_seed(3)
    w13 = (torch.randn(4, 16, 8, generator=g) / 4).to(dtype)
    w2 = (torch.randn(4, 8, 8, generator=g) / 4).to(dtype)
    x = torch.randn(9, 8, generator=g)
    ids = torch.randint(0, 4, (9, 2), generator=g)
    ids[::2, 0] = -1
    ids[3] = -1  # a token with no local expert at all
    weights = torch.rand(9, 2, generator=g)
    got = grouped_experts.moe_experts(x, ids, weights, grouped_experts.pack_panels(w13),
                                      grouped_experts.pack_panels(w2), 8)
    kept = torch.where(ids >= 0, weights, torch.zeros_like(weights))
    ref = _reference_moe(x, ids.clamp(min=0), kept, w13, w2).float()
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[3], torch.zeros(8))


def _layer(dtype: torch.dtype, seed: int = 0) -> SparseMoE:
    moe = seeded_moe(dtype, seed)
    moe.prepack()
    return moe


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5, 16, 64])
def test_the_layer_takes_the_native_path_with_the_per_expert_result(dtype: torch.dtype, tokens: int,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    moe = _layer(dtype)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(dtype)
    calls = []
    native = grouped_experts.moe_experts
    monkeypatch.setattr(grouped_experts, "moe_experts", lambda *a: calls.append(1) or native(*a))
    with torch.inference_mode():
        got = moe(x)
        monkeypatch.setattr(grouped_experts, "available", lambda dtype: False)
        plain = moe(x)
    assert calls == [1] and got.dtype == dtype
    # the per-expert path rounds to bf16 between its matmuls; the kernel keeps fp32 sums
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2 * plain.abs().max().item()
    assert (got.float() - plain.float()).abs().max().item() <= tolerance


def test_in_fp32_the_rows_per_expert_choose_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """8 experts, top-2: 256 tokens are 64 rows per expert (native), 264 are 66 (the library's)."""
    moe = _layer(torch.float32)
    calls = []
    native = grouped_experts.moe_experts
    monkeypatch.setattr(grouped_experts, "moe_experts", lambda *a: calls.append(len(a[0])) or native(*a))
    with torch.inference_mode():
        for tokens in (256, 264):
            moe(torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)))
    assert calls == [256]


def test_weights_changed_in_place_are_repacked() -> None:
    moe = _layer(torch.float32)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(3))
    before, after = outputs_around_doubling_down(moe, x)
    assert torch.allclose(after, 2 * before, atol=1e-5)


def test_autograd_keeps_the_pytorch_path() -> None:
    moe = _layer(torch.float32)
    moe(torch.randn(3, 64)).sum().backward()
    assert moe.w_gate_up.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 40), (7, 40), (2, 3, 40)])
def test_native_linear_matches_f_linear_with_bias_and_any_leading_shape(dtype: torch.dtype,
                                                                        shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape))
    layer = NativeLinear(40, 33, bias=True).to(dtype)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(33, 40, generator=g))
        layer.bias.copy_(torch.randn(33, generator=g))
    layer.prepack()
    x = torch.randn(shape, generator=g).to(dtype)
    with torch.inference_mode():
        got = layer(x)
    with torch.no_grad():
        want = F.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert got.shape == (*shape[:-1], 33) and got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * want.abs().max().item()
    assert _max_error(got, want) <= tolerance


def test_native_linear_repacks_when_its_weight_changes_and_trains_on_the_plain_path() -> None:
    layer = NativeLinear(16, 8, bias=False)
    layer.prepack()
    x = torch.randn(3, 16)
    with torch.inference_mode():
        before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-1)
    with torch.inference_mode():
        assert torch.allclose(layer(x), -before, atol=1e-5)
    layer(x).sum().backward()
    assert layer.weight.grad is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_weights_large_enough_to_share_out_give_the_same_sums_on_two_threads(dtype: torch.dtype) -> None:
    """Above the per-thread size the kernels split panels (linear) and experts (MoE) between
    threads; every output is still summed by one thread in one order, so the results are equal
    to the single-thread ones bit for bit, and to the reference."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 512, generator=g)
    weight = (torch.randn(4096, 512, generator=g) / 20).to(dtype)  # 4-8 MB: two threads
    experts, inter = 8, 512
    w13 = (torch.randn(experts, 2 * inter, 512, generator=g) / 20).to(dtype)
    w2 = (torch.randn(experts, 512, inter, generator=g) / 20).to(dtype)
    ids = torch.randint(0, experts, (12, 2), generator=g)
    weights = torch.rand(12, 2, generator=g)
    packed, p13, p2 = (grouped_experts.pack_panels(w) for w in (weight, w13, w2))
    previous = torch.get_num_threads()
    results = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            results[threads] = (grouped_experts.linear(x, packed, 4096),
                                grouped_experts.moe_experts(x, ids, weights, p13, p2, inter))
    finally:
        torch.set_num_threads(previous)
    for one, two in zip(results[1], results[2]):
        assert torch.equal(one, two)
    assert torch.allclose(results[2][0], x @ weight.float().T, atol=1e-3, rtol=1e-4)
    ref = _reference_moe(x, ids, weights, w13, w2).float()
    assert torch.allclose(results[2][1], ref, atol=1e-3, rtol=1e-3)
