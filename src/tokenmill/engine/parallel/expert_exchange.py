"""Wide expert parallelism under attention data parallelism: each rank brings its own tokens
to the MoE layer, and every token must reach the ranks that hold its experts and come back.

Dispatch is an all-gather and combine a reduce-scatter, rather than an all-to-all with
variable counts: gloo has no all-to-all with per-peer sizes, and on one host (loopback, every
rank's tokens a few KB each) sending every token to every rank costs about what sending each
one only where its experts live would, while the two collectives need no count exchange of
their own. Each rank pads its rows to the step's largest count (known from the step message,
so no collective is spent on it); padding rows carry expert id -1, which the experts skip, and
a rank with no tokens at all still joins both collectives of every MoE layer.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.engine.parallel.group import RankGroup


class ExpertExchange:
    """One per rank, shared by its MoE layers; `begin_step` before each forward pass."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.counts: list[int] = [0] * group.world  # tokens of each rank in this step

    def begin_step(self, counts: Sequence[int]) -> None:
        if len(counts) != self.group.world:
            raise ValueError(f"a step names {len(counts)} ranks' token counts; the group has {self.group.world}")
        self.counts = list(counts)

    @property
    def rows(self) -> int:
        """Rows per rank in the exchanged blocks: the step's largest token count."""
        return max(self.counts)

    def dispatch(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's tokens with their router choices in, every rank's out (rank order,
        each padded to `rows`): hidden states in x's dtype, expert ids, router weights."""
        n, hidden, k = x.shape[0], x.shape[1], experts.shape[1]
        packed = torch.zeros(self.rows, hidden + 2 * k, dtype=torch.float32)
        packed[:n, :hidden] = x
        packed[:n, hidden:hidden + k] = weights
        packed[:, hidden + k:] = -1.0  # ids are small integers: exact in fp32
        packed[:n, hidden + k:] = experts
        every = self.group.all_gather(packed).flatten(0, 1)
        return (every[:, :hidden].to(x.dtype), every[:, hidden + k:].long(),
                every[:, hidden:hidden + k].contiguous())

    def combine(self, out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Every rank's partial expert outputs for every token in; this rank's tokens' sums out."""
        mine = self.group.reduce_scatter(out)
        return mine[:self.counts[self.group.rank]].to(dtype)
