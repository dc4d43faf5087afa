"""`NativeLinear`: an `nn.Linear` (same parameters, same state-dict names) whose CPU inference
calls take the native small-M kernel (`kernels/grouped_experts.py`) where it is the faster path:
decode-sized batches everywhere, every batch for bf16 on CPUs without native bf16 matmuls.

It keeps a copy of its weight packed in 16-row panels beside the weight (twice the memory of
the dense weights: the price of keeping `F.linear` for the other calls), packed by `prepack()`
once the weights are loaded and again whenever the weight changes in place.

`batch_invariant` sends every CPU inference call through the native kernel, whatever its rows:
it sums each output in one fixed order (k ascending) for any M, where a GEMM library's blocking,
and so its rounding, changes with M.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.engine.kernels import grouped_experts


class NativeLinear(nn.Linear):
    _panels: torch.Tensor | None = None
    _packed_from: tuple[int, int] = (0, -1)  # the weight's (storage, version) the panels hold
    batch_invariant = False

    def prepack(self) -> None:
        if self.weight.device.type == "cpu" and grouped_experts.available(self.weight.dtype):
            with torch.no_grad():
                self._panels = grouped_experts.pack_panels(self.weight)
            self._packed_from = self._source()

    def _source(self) -> tuple[int, int]:
        return self.weight.data_ptr(), self.weight._version

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features if x.dim() else 0
        if not grouped_experts.use_native(x, self.weight.dtype, rows, self.batch_invariant):
            return F.linear(x, self.weight, self.bias)
        if self._panels is None or self._packed_from != self._source():
            self.prepack()
        y = grouped_experts.linear(x.reshape(rows, self.in_features), self._panels, self.out_features)
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)
