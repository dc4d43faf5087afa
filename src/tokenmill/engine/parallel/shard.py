"""What one rank of a tensor- or expert-parallel worker holds.

A worker spans `world` ranks. With `tp == world`, attention heads, KV heads (replicated when
there are fewer KV heads than ranks), the dense MLP's intermediate size and, without EP, each
expert's intermediate size are split between ranks: q/k/v and gate/up are column-parallel, o
and down row-parallel, and each block half ends in one all-reduce. With `ep == world`, the
experts themselves are split (rank r holds a contiguous range); every rank runs the router
over all experts and computes the assignments to its own, and the MoE output is all-reduced.
With EP alone attention and dense layers run whole on every rank (replicated, no collective).
With attention DP (`dp == ep == world`, the wide-EP layout) the shards are EP's, but each rank
runs attention and dense layers for its own requests on its own KV, and the MoE layers
exchange tokens between ranks (`expert_exchange.py`) instead of summing replicated work.
The embedding, norms, router and LM head are whole on every rank (the documented simpler
choice over vocabulary parallelism: they are small next to the experts).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tokenmill.textgen.model_config import ModelConfig, load_model_config

if TYPE_CHECKING:
    from tokenmill.engine.config import EngineConfig


class LayoutError(ValueError):
    """A layout that does not fit the model or the machine; `flag` names the CLI flag."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


@dataclass(slots=True, frozen=True)
class ParallelLayout:
    tp: int = 1
    ep: int = 1
    dp: int = 1  # attention data parallel: each rank its own requests and KV (with ep == dp)

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    def validate(self, cfg: ModelConfig, cores: int) -> None:
        """Raises LayoutError naming the flag at fault."""
        for flag, n in (("--tp", self.tp), ("--ep", self.ep), ("--attention-dp", self.dp)):
            if n < 1:
                raise LayoutError(flag, f"must be at least 1, got {n}")
        if self.dp > 1 and (self.ep != self.dp or self.tp != 1):
            raise LayoutError("--attention-dp", f"{self.dp} needs --ep {self.dp} and no --tp (the wide-EP "
                                                f"layout: attention data-parallel, experts split), got "
                                                f"--ep {self.ep} --tp {self.tp}")
        if self.tp > 1 and self.ep > 1 and self.tp != self.ep:
            raise LayoutError("--ep", f"with --tp {self.tp} must be 1 or {self.tp} (one group of ranks)")
        if self.world > cores:
            raise LayoutError("--tp" if self.tp >= self.ep else "--ep",
                              f"{self.world} ranks but only {cores} cores: a rank per core at most")
        if self.tp > 1:
            _check_tp(cfg, self.tp, split_experts=self.ep == 1)
        if self.ep > 1:
            if cfg.moe is None:
                raise LayoutError("--ep", f"{cfg.architecture} has no experts to split")
            if cfg.moe.num_experts % self.ep:
                raise LayoutError("--ep", f"{cfg.moe.num_experts} experts do not divide into {self.ep} ranks")


def check_layout(config: EngineConfig) -> ParallelLayout:
    """The engine config's layout, checked against its model and this machine (torch-free, so a
    frontend can refuse bad flags before any worker starts). Raises LayoutError."""
    layout = ParallelLayout(config.tp, config.ep, config.attention_dp)
    if layout.world > 1 or layout.dp > 1:
        flag = "--tp" if config.tp > 1 else "--attention-dp" if config.attention_dp > 1 else "--ep"
        if config.runner != "torch":
            raise LayoutError(flag, "needs --runner torch (the mock runner has no forward pass to split)")
        if config.kv_tiers_enabled:
            raise LayoutError(flag, "KV tiers do not work with a parallel worker yet (each rank holds "
                                    "part of the KV)")
    layout.validate(load_model_config(config.model), os.cpu_count() or 1)
    return layout


def _check_tp(cfg: ModelConfig, tp: int, split_experts: bool) -> None:
    if cfg.num_heads % tp:
        raise LayoutError("--tp", f"{cfg.num_heads} attention heads do not divide into {tp} ranks")
    if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
        raise LayoutError("--tp", f"{cfg.num_kv_heads} KV heads neither divide into {tp} ranks nor divide {tp}")
    if cfg.intermediate_size % tp:
        raise LayoutError("--tp", f"intermediate size {cfg.intermediate_size} does not divide into {tp} ranks")
    if split_experts and cfg.moe is not None and cfg.moe.intermediate_size % tp:
        raise LayoutError("--tp", f"expert intermediate size {cfg.moe.intermediate_size} does not divide into {tp}")


@dataclass(slots=True, frozen=True)
class Shard:
    """Rank `rank`'s ranges, each [start, stop) in the full model's numbering."""
    rank: int
    layout: ParallelLayout
    heads: tuple[int, int]
    kv_heads: tuple[int, int]
    intermediate: tuple[int, int]
    experts: tuple[int, int]
    expert_intermediate: tuple[int, int]

    @property
    def attention_split(self) -> bool:
        return self.layout.tp > 1

    @property
    def mlp_split(self) -> bool:
        return self.layout.tp > 1

    @property
    def moe_split(self) -> bool:
        return self.layout.world > 1

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """The config of this rank's slice: its heads, KV heads and intermediate sizes."""
        moe = cfg.moe
        if moe is not None:
            moe = dataclasses.replace(moe, intermediate_size=_size(self.expert_intermediate))
        return dataclasses.replace(cfg, num_heads=_size(self.heads), num_kv_heads=_size(self.kv_heads),
                                   intermediate_size=_size(self.intermediate), moe=moe)


def _size(span: tuple[int, int]) -> int:
    return span[1] - span[0]


def _part(total: int, parts: int, index: int) -> tuple[int, int]:
    step = total // parts
    return index * step, (index + 1) * step


def shard_for(cfg: ModelConfig, layout: ParallelLayout, rank: int) -> Shard:
    """Rank `rank`'s shard (the layout must have been validated against `cfg`)."""
    tp = layout.tp
    heads = _part(cfg.num_heads, tp, rank) if tp > 1 else (0, cfg.num_heads)
    if tp > 1 and cfg.num_kv_heads % tp == 0:
        kv_heads = _part(cfg.num_kv_heads, tp, rank)
    elif tp > 1:  # fewer KV heads than ranks: each rank keeps the one its query heads read
        kv = rank // (tp // cfg.num_kv_heads)
        kv_heads = (kv, kv + 1)
    else:
        kv_heads = (0, cfg.num_kv_heads)
    intermediate = _part(cfg.intermediate_size, tp, rank) if tp > 1 else (0, cfg.intermediate_size)
    experts, expert_inter = (0, 0), (0, 0)
    if cfg.moe is not None:
        experts = _part(cfg.moe.num_experts, layout.ep, rank) if layout.ep > 1 else (0, cfg.moe.num_experts)
        split_inner = tp > 1 and layout.ep == 1
        expert_inter = _part(cfg.moe.intermediate_size, tp, rank) if split_inner else (0, cfg.moe.intermediate_size)
    return Shard(rank, layout, heads, kv_heads, intermediate, experts, expert_inter)
