"""The sparse MoE MLP (Qwen3-MoE): a top-k softmax router, then each token through its experts.

The experts run on one of three paths, chosen per call:
- **native** (`kernels/grouped_experts.py`): every active expert of the layer in one C call,
  each expert's weights read once per step. Used for small batches (decode), where library
  GEMMs spend most of their time per call rather than per byte, in fp32 up to prefill chunks
  whose experts get as few rows each (`_gemm_rows`), and for every batch on CPUs without
  native bf16 matmuls, where it is also the faster compute path (`use_native`).
- **oneDNN-packed** (`kernels/packed_linear.py`): bf16 on CPUs with native bf16, large batches.
- **plain** `F.linear` per expert: everything else (autograd, other devices, no kernels).
All three compute the same function; the native path keeps its sums in fp32 throughout.

The router's gate is a `NativeLinear` too: at decode sizes its scores come from the native
kernel, as the dense layers' do.

`batch_invariant` makes a token's output independent of the other tokens in the call: the
native path for every batch (a token's experts summed in expert order, each matmul in one fixed
order; the gate's too), and ties in the top-k broken by the lower expert id.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine.kernels import grouped_experts
from tokenmill.engine.kernels.packed_linear import PackedLinear, bf16_packing_available, pack_experts
from tokenmill.engine.models.native_linear import NativeLinear
from tokenmill.textgen.model_config import MoEConfig

if TYPE_CHECKING:
    from tokenmill.engine.parallel.expert_exchange import ExpertExchange


class SparseMoE(nn.Module):
    """Top-k softmax router; each expert runs only on the tokens routed to it.

    On an expert-parallel rank it holds only `local_experts` = [first, stop): the router still
    scores every expert, the assignments to other ranks' experts are skipped here, and `reduce`
    (set by the rank) sums the ranks' partial outputs. Tensor-parallel ranks hold every expert
    with a slice of its intermediate size, and reduce the same way. Under attention data
    parallelism each rank has its own tokens instead: `exchange` brings every rank's tokens
    (and router choices) here and takes each rank's sums back."""
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    exchange: ExpertExchange | None = None
    batch_invariant = False

    def __init__(self, hidden: int, moe: MoEConfig, local_experts: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = moe.top_k, moe.norm_topk_prob
        self.first_expert, stop = local_experts or (0, moe.num_experts)
        self.num_experts, self.intermediate = stop - self.first_expert, moe.intermediate_size
        self.gate = NativeLinear(hidden, moe.num_experts, bias=False)
        self.w_gate_up = nn.Parameter(torch.empty(self.num_experts, 2 * moe.intermediate_size, hidden))
        self.w_down = nn.Parameter(torch.empty(self.num_experts, hidden, moe.intermediate_size))
        self._packed: tuple[list[PackedLinear], list[PackedLinear]] | None = None
        self._panels: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None

    def prepack(self) -> None:
        """Pack the expert weights now, once they are loaded: packed lazily, the first forward
        would carry the cost (~80 ms a layer on small-moe) into some request's latency."""
        self._packed = self._pack()
        self._panels = self._pack_panels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = self._top_k(probs)
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        dtype = x.dtype
        if self.exchange is not None:
            x, experts, weights = self.exchange.dispatch(x, experts, weights)
        experts = self._local_ids(experts)
        panels = self._native_panels(x, experts)
        if panels is not None:
            out = grouped_experts.moe_experts(x, experts, weights, panels[0], panels[1], self.intermediate)
            out = out.to(x.dtype)
        else:
            out = self._per_expert(x, experts, weights.to(x.dtype))
        if self.exchange is not None:
            return self.exchange.combine(out, dtype)
        return out if self.reduce is None else self.reduce(out)

    def _top_k(self, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.batch_invariant:
            return probs.topk(self.top_k, dim=-1)
        weights, experts = probs.sort(dim=-1, descending=True, stable=True)  # ties: the lower id first
        return weights[:, :self.top_k], experts[:, :self.top_k]

    def _local_ids(self, experts: torch.Tensor) -> torch.Tensor:
        """Expert ids in this module's numbering; -1 for experts another rank holds."""
        if self.first_expert == 0 and self.num_experts == self.gate.out_features:
            return experts
        local = experts - self.first_expert
        return torch.where((local >= 0) & (local < self.num_experts), local, -1)

    def _per_expert(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one dense GEMM per expert on its contiguous slice, then
        scattered back weighted by the router. Assignments to id -1 (another rank's) are skipped."""
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] >= 0]
        counts = torch.bincount(flat[order], minlength=self.num_experts).tolist()
        token_of = order // self.top_k
        xs = x.index_select(0, token_of)
        outs = torch.empty_like(xs)
        packed = self._packed_experts(x)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = xs[start:start + n]
                if packed is None:
                    gate, up = F.linear(rows, self.w_gate_up[e]).chunk(2, dim=-1)
                    outs[start:start + n] = F.linear(F.silu(gate) * up, self.w_down[e])
                else:
                    gate, up = packed[0][e](rows).chunk(2, dim=-1)
                    outs[start:start + n] = packed[1][e](F.silu(gate) * up)
                start += n
        outs = outs * weights.flatten()[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add_(0, token_of, outs)

    # ---- packed copies of the expert weights -----------------------------------------------

    def _versions(self) -> tuple[int, int]:
        return self.w_gate_up._version, self.w_down._version

    def _pack_panels(self) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
        if self.w_gate_up.device.type != "cpu" or not grouped_experts.available(self.w_gate_up.dtype):
            return None
        with torch.no_grad():
            return (grouped_experts.pack_panels(self.w_gate_up), grouped_experts.pack_panels(self.w_down),
                    self._versions())

    def _native_panels(self, x: torch.Tensor, experts: torch.Tensor,
                       ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
        """The panels when the native path applies to this call (repacked if the weights changed)."""
        if not grouped_experts.use_native(x, self.w_gate_up.dtype, self._gemm_rows(x, experts), self.batch_invariant):
            return None
        if self._panels is None or self._panels[2] != self._versions():
            self._panels = self._pack_panels()
        return self._panels

    def _gemm_rows(self, x: torch.Tensor, experts: torch.Tensor) -> int:
        """The rows that decide the path: in fp32, the rows of this module's experts' matmuls on
        average (its assignments / its experts, -1 ids being another rank's), since a CPU's fp32
        GEMM has no matrix unit to win with and the library's per-expert GEMMs are as small as
        their rows (a 512-token chunk of top-2 of 16 experts: 64 rows each, 0.77x the library's
        time with AVX-512); in bf16 the call's tokens, for the oneDNN-packed path on matrix units
        (1.9x faster at 512 there)."""
        rows = x.shape[0]
        if x.dtype != torch.float32 or rows <= grouped_experts.NATIVE_MAX_ROWS:
            return rows
        assigned = int((experts >= 0).sum())
        return min(rows, -(-assigned // self.num_experts))

    def _pack(self) -> tuple[list[PackedLinear], list[PackedLinear]] | None:
        gate_up, down = pack_experts(self.w_gate_up), pack_experts(self.w_down)
        return (gate_up, down) if gate_up and down else None

    def _packed_experts(self, x: torch.Tensor) -> tuple[list[PackedLinear], list[PackedLinear]] | None:
        """Expert weights packed once for oneDNN (bf16 CPU inference only): with few rows per
        expert, re-packing them on every call is most of the MoE's time (kernels/packed_linear.py).
        Repacked when the weights change; None where packing does not apply."""
        if x.dtype != torch.bfloat16 or x.device.type != "cpu" or torch.is_grad_enabled() \
                or not bf16_packing_available():
            return None
        packed = self._packed
        if packed is None or packed[0][0].stale(self.w_gate_up[0]) or packed[1][0].stale(self.w_down[0]):
            packed = self._packed = self._pack()
        return packed

