"""Starting a parallel worker's ranks from an engine config: validate the layout against the
model and the machine, start ranks 1..N-1, and build rank 0's shard and runner."""
from __future__ import annotations

import torch

from tokenmill.engine.config import EngineConfig
from tokenmill.engine.parallel.dp_runner import DataParallelRunner
from tokenmill.engine.parallel.ranks import ParallelRunner, RankProcesses, RankSpec, attach_collectives
from tokenmill.engine.parallel.shard import check_layout, shard_for
from tokenmill.engine.runner_protocol import KVAllocator
from tokenmill.engine.weights import load_model
from tokenmill.textgen.model_config import ModelConfig


def parallel_runner(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype, num_blocks: int,
                    max_positions: int, kv_allocator: KVAllocator | None) -> ParallelRunner:
    layout = check_layout(config)
    if kv_allocator is not None:
        raise ValueError("--tp/--ep: a parallel worker's KV cache is per rank; shared-memory KV "
                         "(disaggregated handoff, KV tiers) does not work with it yet")
    # the worker's threads shared out between its ranks, as rank 0's own (LLMEngine)
    threads = config.rank_threads or max(1, torch.get_num_threads() // layout.world)
    spec = RankSpec(config.model, config.dtype_name(cfg), layout, num_blocks, config.block_size, max_positions,
                    threads, config.deterministic)
    ranks = RankProcesses(spec)
    try:
        shard = shard_for(cfg, layout, 0)
        model = load_model(config.model, cfg, dtype, max_positions, shard, batch_invariant=config.deterministic)
        exchange = attach_collectives(model, shard, ranks.group)
        args = (ranks, model, shard.local_config(cfg), num_blocks, config.block_size, dtype, config.seed)
        kwargs = dict(exit_on_rank_loss=config.exit_on_rank_loss, batch_invariant=config.deterministic)
        if exchange is not None:
            return DataParallelRunner(exchange, *args, **kwargs)
        return ParallelRunner(*args, **kwargs)
    except BaseException:
        ranks.kill()
        raise
