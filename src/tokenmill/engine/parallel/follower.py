"""A rank 1..N-1 of a parallel worker (started by `ranks.RankProcesses`): load this rank's
shard, join the group, then run every step rank 0 broadcasts until it says stop or dies."""
from __future__ import annotations

import argparse
import logging
import sys
from datetime import timedelta

import torch

from tokenmill.engine.attention import allocate_kv_cache
from tokenmill.engine.config import DTYPES
from tokenmill.engine.parallel.dp_runner import run_rank_step
from tokenmill.engine.parallel.group import IDLE_WAIT, RankGroup
from tokenmill.engine.parallel.ranks import attach_collectives
from tokenmill.engine.parallel.shard import ParallelLayout, shard_for
from tokenmill.engine.parallel.step_wire import STOP, unpack_ranks_step, unpack_step
from tokenmill.engine.weights import load_model
from tokenmill.textgen.model_config import load_model_config

log = logging.getLogger(__name__)


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tokenmill.engine.parallel.follower")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True, choices=sorted(DTYPES))
    for name in ("--tp", "--ep", "--attention-dp", "--rank", "--port", "--num-blocks", "--block-size",
                 "--max-positions", "--threads"):
        p.add_argument(name, type=int, required=True)
    p.add_argument("--timeout-s", type=float, required=True)
    p.add_argument("--deterministic", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level="WARNING", format=f"%(asctime)s rank {args.rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(args.threads)
    layout = ParallelLayout(args.tp, args.ep, args.attention_dp)
    cfg = load_model_config(args.model)
    shard = shard_for(cfg, layout, args.rank)
    local = shard.local_config(cfg)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, cfg, dtype, args.max_positions, shard, batch_invariant=args.deterministic)
    kv_cache = allocate_kv_cache(local.num_layers, args.num_blocks, args.block_size, local.num_kv_heads,
                                 local.head_dim, dtype)
    group = RankGroup(args.rank, layout.world, args.port, timedelta(seconds=args.timeout_s))
    exchange = attach_collectives(model, shard, group)
    try:
        while (data := group.broadcast_bytes(None, wait=IDLE_WAIT)) != STOP:
            if exchange is not None:  # attention DP: this rank's own batch
                counts, rows, step = unpack_ranks_step(data, args.rank)
                run_rank_step(model, kv_cache, exchange, counts, rows, step)
                continue
            input_ids, positions, batch, logits_rows = unpack_step(data)
            model(input_ids, positions, kv_cache, batch, logits_rows[:0])  # logits: rank 0 only
    except RuntimeError as exc:  # rank 0 or a peer died: the collective failed or timed out
        log.warning("leaving: %s", exc)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
