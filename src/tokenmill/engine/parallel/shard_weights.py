"""Which part of each checkpoint tensor a rank reads, so that a rank reads only its shard
(`safe_open(...).get_slice(name)[index]`), and the name that part takes in its own model."""
from __future__ import annotations

import re
from enum import Enum

from tokenmill.engine.parallel.shard import Shard
from tokenmill.textgen.model_config import ModelConfig

_LAYER_REST = re.compile(r"model\.layers\.\d+\.(.+)")
_EXPERT = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(\d+)(\..+)")


class Part(Enum):
    SKIP = "skip"  # another rank's expert: not read at all
    ZERO = "zero"  # a row-parallel bias, added by rank 0 only


Index = tuple[slice, ...] | Part | None  # None: the whole tensor


def source_index(shard: Shard, cfg: ModelConfig, name: str) -> Index:
    m = _LAYER_REST.fullmatch(name)
    if m is None:
        return None
    rest, d = m.group(1), cfg.head_dim
    if shard.attention_split and rest.startswith("self_attn."):
        return _attention(shard, rest, d)
    e = _EXPERT.fullmatch(name)
    if e is not None:
        expert = int(e.group(2))
        if not shard.experts[0] <= expert < shard.experts[1]:
            return Part.SKIP
        return _mlp(shard.expert_intermediate, e.group(3)[1:], shard.rank, split=cfg.moe is not None
                    and shard.expert_intermediate[1] - shard.expert_intermediate[0] < cfg.moe.intermediate_size)
    if rest.startswith("mlp.experts.") and shard.moe_split:
        raise ValueError(f"{name}: fused expert tensors are not split between ranks; "
                         "use a checkpoint with one tensor per expert")
    if shard.mlp_split and rest.startswith("mlp.") and not rest.startswith("mlp.gate."):
        return _mlp(shard.intermediate, rest[len("mlp."):], shard.rank, split=True)
    return None


def _attention(shard: Shard, rest: str, d: int) -> Index:
    proj, _, kind = rest[len("self_attn."):].partition(".")
    if proj == "q_proj":
        return (slice(shard.heads[0] * d, shard.heads[1] * d),)
    if proj in ("k_proj", "v_proj"):
        return (slice(shard.kv_heads[0] * d, shard.kv_heads[1] * d),)
    if proj == "o_proj":
        if kind == "bias":
            return None if shard.rank == 0 else Part.ZERO
        return (slice(None), slice(shard.heads[0] * d, shard.heads[1] * d))
    return None  # q_norm / k_norm: per head_dim, the same on every rank


def _mlp(span: tuple[int, int], rest: str, rank: int, split: bool) -> Index:
    if not split:
        return None
    proj, _, kind = rest.partition(".")
    rows = slice(*span)
    if proj in ("gate_proj", "up_proj"):
        return (rows,)
    if proj == "down_proj":
        if kind == "bias":
            return None if rank == 0 else Part.ZERO
        return (slice(None), rows)
    return None


def local_name(shard: Shard, name: str) -> str:
    """Expert tensors renumbered from the rank's first expert."""
    e = _EXPERT.fullmatch(name)
    if e is None or shard.experts[0] == 0:
        return name
    return f"{e.group(1)}{int(e.group(2)) - shard.experts[0]}{e.group(3)}"
