"""`tokenmill bench tenants`'s simulated column: the same fleet and load in the fleet simulator.

The fleet is the live run's (the mock profile's replicas, `--max-num-seqs`,
`--max-num-batched-tokens`, the frontend's slots and batch share, the tenants' classes); the interactive tenant's
arrivals are the live run's own. The batch tenant's closed-loop flood
becomes an open queue of requests all there at the start, more than the run can serve: the
frontend's queue stays full either way, which is what the flood is for. Figures are taken over
`--duration-s`: the interactive requests' TTFT (the frontend queue's wait included), the
tokens streamed in that time (a request's tokens spread evenly over its stream), and the replicas'
step time by then over the workers' wall time.
"""
from __future__ import annotations

import argparse
import math

from tokenmill.bench.harness.serve_stats import distribution_ms
from tokenmill.sim.fleet.arrivals import TraceRequest
from tokenmill.sim.fleet.clock import parse_profile
from tokenmill.sim.fleet.config import FleetConfig
from tokenmill.sim.fleet.fleet import FleetSim
from tokenmill.sim.fleet.records import RequestRecord
from tokenmill.tenants.config import Tenant

MAX_STREAM_TOK_S = 200.0  # above any profile's single-stream decode rate: bounds what a slot serves in the run


def simulate_mode(args: argparse.Namespace, mode: str, arrivals: list[float], frontend_slots: int,
                  batch_share: float, classes: dict[str, str]) -> dict:
    """One mode in the fleet simulator, the interactive requests arriving at `arrivals` (seconds):
    the `ModeRun` fields, as a dict."""
    slots = args.workers * args.max_num_seqs
    tenants = tuple(Tenant(name, (), cls) for name, cls in classes.items())
    config = FleetConfig(profiles={"agg": parse_profile(args.mock_profile, "--mock-profile")}, agg=args.workers,
                         max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens,
                         tenants=tenants, max_in_flight=frontend_slots, batch_share=batch_share, seed=args.seed)
    interactive = [_request(i, "i", at_s, args.prompt_tokens, args.interactive_output_tokens, "assistant",
                            config.block_size) for i, at_s in enumerate(arrivals)]
    flood = [] if mode == "unloaded" else _flood(args, slots, len(interactive), config.block_size)
    sim = FleetSim(config)
    busy: list[float] = []  # the replicas' step time when the run's time is up
    sim.run(interactive + flood, controller=lambda s: busy.append(sum(r.busy_s for r in s.replicas.values())),
            tick_s=args.duration_s)
    mine = [sim.records[r.request_id] for r in interactive]
    theirs = [sim.records[r.request_id] for r in flood]
    ok_i = [r for r in mine if r.finished]
    batch_tokens = sum(_tokens_within(r, args.duration_s) for r in theirs)
    all_tokens = batch_tokens + sum(_tokens_within(r, args.duration_s) for r in mine)
    ttft = distribution_ms([r.ttft_s for r in ok_i if r.ttft_s is not None])
    return {"mode": mode, "repeat": 0, "interactive_ok": len(ok_i), "interactive_sent": len(mine),
            "interactive_ttft": ttft, "batch_ok": sum(1 for r in theirs if r.finished and r.last_token_s is not None
                                                      and r.last_token_s <= args.duration_s),
            "batch_output_tok_s": batch_tokens / args.duration_s, "fleet_output_tok_s": all_tokens / args.duration_s,
            "fleet_utilisation": busy[0] / (args.duration_s * args.workers) if busy else None}


def _flood(args: argparse.Namespace, slots: int, first: int, block_size: int) -> list[TraceRequest]:
    """More batch requests than the fleet's slots could stream in the run, all there at the start."""
    per_slot = math.ceil(args.duration_s * MAX_STREAM_TOK_S / args.batch_output_tokens)
    count = max(round(args.flood * slots), slots * per_slot)
    return [_request(first + i, "b", 0.0, args.prompt_tokens, args.batch_output_tokens, "sweeps", block_size)
            for i in range(count)]


def _request(index: int, prefix: str, at_s: float, prompt: int, output: int, tenant: str,
             block_size: int) -> TraceRequest:
    """Random prompts share no prefix: every request's block hashes are its own."""
    blocks = prompt // block_size
    return TraceRequest(f"{prefix}{index}", at_s, prompt, output,
                        tuple(range(index * blocks + 1, (index + 1) * blocks + 1)), tenant)


def _tokens_within(record: RequestRecord, until_s: float) -> float:
    if record.first_token_s is None or record.first_token_s > until_s:
        return 0.0
    end = record.last_token_s if record.last_token_s is not None else until_s
    if end <= until_s or end <= record.first_token_s:
        return float(record.tokens)
    return record.tokens * (until_s - record.first_token_s) / (end - record.first_token_s)
