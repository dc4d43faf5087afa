"""`tokenmill serve … --planner sla|load|hybrid`: the planner inside the serving process.

It is the local connector of `tokenmill planner run`, talking to this process's own app through
an in-memory ASGI transport (no socket, the same routes and admin key a separate planner would
use), started with the HTTP server and stopped with it. Its decisions are served at
`GET /admin/planner` and its series join the frontend's `/metrics`.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from tokenmill.planner.flags import check_planner_flags
from tokenmill.planner.live import LiveDeployment
from tokenmill.planner.metrics import PlannerMetrics
from tokenmill.planner.setup import hold_from, limits_from, make_forecaster, make_planner
from tokenmill.sim.fleet.clock import StepClock, parse_profile

log = logging.getLogger(__name__)


def check_flags(args: argparse.Namespace) -> None:
    """Refuse bad planner flags before anything starts (ValueError naming the flag)."""
    limits_from(args)
    check_planner_flags(args)
    text = args.planner_profile or getattr(args, "mock_profile", None)
    if not text:
        raise ValueError("--planner-profile: the planner needs a replica profile (or workers with --mock-profile)")
    StepClock(parse_profile(text, "--planner-profile"))
    if args.slo_ttft_ms <= 0 or args.slo_itl_ms <= 0:
        raise ValueError("--slo-ttft-ms and --slo-itl-ms must be > 0")
    if args.planner_interval_s <= 0:
        raise ValueError("--planner-interval-s must be > 0")
    if args.api_servers > 1:
        raise ValueError("--planner: one planner per deployment; run it with --api-servers 1 "
                         "(or as `tokenmill planner run`)")


class SpedUpClock:
    """A step-time clock whose seconds pass `speedup` times faster: what `--mock-speedup` workers
    take in wall time, so the planner's capacities and latencies are in the same time."""

    def __init__(self, clock: StepClock, speedup: float) -> None:
        self.inner, self.speedup = clock, speedup
        self.profile, self.context = clock.profile, clock.context

    def seconds(self, work: Any) -> float:
        return self.inner.seconds(work) / self.speedup

    def kv_capacity_tokens(self) -> int:
        return self.inner.kv_capacity_tokens()


@dataclass(slots=True)
class PlannerTask:
    deployment: LiveDeployment
    stop: asyncio.Event
    task: asyncio.Task[None]

    def decisions(self) -> list[dict[str, Any]]:
        return [d.to_json() for d in self.deployment.planner.decisions]

    async def close(self) -> None:
        self.stop.set()
        await asyncio.gather(self.task, return_exceptions=True)
        await self.deployment.client.aclose()


def start(app: Any, args: argparse.Namespace, registry: Any, admin_key: str | None) -> PlannerTask:
    """Plan for the deployment `app` serves; ValueError naming the flag on bad planner flags."""
    text = args.planner_profile or getattr(args, "mock_profile", None)
    if not text:
        raise ValueError("--planner-profile: the planner needs a replica profile (or workers with --mock-profile)")
    profile = parse_profile(text, "--planner-profile")
    speedup = float(getattr(args, "mock_speedup", 1.0) or 1.0) if getattr(args, "mock_profile", None) else 1.0
    disaggregated = bool(getattr(args, "prefill", 0))
    forecaster = make_forecaster(args.predictor, args.warm_start_trace, args.planner_interval_s)
    planner = make_planner({"agg": profile, "prefill": profile, "decode": profile}, disaggregated,
                           args.planner_mode, forecaster, limits_from(args),
                           args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3, args.max_num_seqs,
                           args.max_num_batched_tokens, _kv_tokens(args),
                           (args.lookahead_s or 0.0) / args.planner_interval_s, args.forecast_quantile,
                           args.burst_quantile, hold=hold_from(args))
    if speedup != 1.0:
        for model in planner.proposer.models.values():
            model.clock = SpedUpClock(model.clock, speedup)  # type: ignore[assignment]
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://tokenmill", headers=headers,
                               timeout=30.0)
    gpus = {role: m.gpus for role, m in planner.proposer.models.items()}
    deployment = LiveDeployment(planner, client, args.planner_interval_s, args.warmup_s, PlannerMetrics(registry, gpus),
                                fast_s=args.fast_path_s)
    stop = asyncio.Event()
    task = asyncio.create_task(deployment.run(stop))
    log.info("planner %s running every %g s", args.planner_mode, args.planner_interval_s)
    return PlannerTask(deployment, stop, task)


def _kv_tokens(args: argparse.Namespace) -> dict[str, int] | None:
    blocks = getattr(args, "kv_cache_blocks", None)
    if not blocks:
        return None
    return {role: blocks * args.block_size for role in ("agg", "prefill", "decode")}
