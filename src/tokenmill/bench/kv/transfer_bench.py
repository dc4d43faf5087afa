"""`tokenmill bench transfer`: KV-block transfer throughput over shm and tcp vs raw baselines.

Two agents in two processes: a "prefill" agent in a child process (`transfer.peer_process`)
owns a KV pool in shared memory filled with random bytes; the "decode" agent here pulls block
sets of each `--sizes-mb` into its own pool with `TransferAgent.read`, timed from the call to
completion (validation, coalescing and the backend's work included), median of `--repeats`.
Each (backend, case, size) is first pulled once with `expected_checksum` set, so every figure
is for bytes that arrived intact.

Cases: `contiguous` (consecutive block ids on both sides: one descriptor per layer and K/V) and
`scattered` (random ids on both sides: one `--block-kb` descriptor per block, layer and K/V).
Baselines measured in the same run on the same bytes: `memcpy` (one numpy copy in this process)
and `raw socket` (a child process `sendall`s the bytes over 127.0.0.1 into a blocking
`recv_into` loop here). Targets for sizes >= 16 MB: shm >= 0.6x memcpy, tcp >= 0.6x raw socket.

`--netns` (root and iproute2): tcp across hosts, or as near as one machine gets. One network
namespace on a bridge (`tokenmill.runtime.netns.Hosts(1)`); the prefill peer runs inside it, its
tcp backend bound to and advertising the namespace's address (10.231.<k>.1), and the agent here
pulls from the root namespace (10.231.<k>.254) across the veth pair and the bridge; the raw
socket's sender runs in the same namespace, so both figures cross the same veth. Only tcp is
measured (shm cannot cross hosts); rows carry `netns: true`, the report the route. The children
enter the namespace with setns(2) (ctypes; Python 3.11 has no os.setns) as their first act,
before any socket or thread: the spawn + pipe handles stay as they are, whereas launching them
through `ip netns exec` would need a custom executable for multiprocessing and would put them in
a mount namespace of their own as well. The namespace and bridge are deleted at the end, on
errors and Ctrl-C too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.kv.transfer_baselines import LOOPBACK, memcpy_gbps, raw_socket_gbps

log = logging.getLogger(__name__)

TARGET_RATIO = 0.6
TARGET_MIN_MB = 16
BLOCK_TOKENS = 16


@dataclass(slots=True)
class TransferRow:
    size_mb: int
    backend: str
    case: str
    descriptors: int
    gbps: float
    baseline: str
    baseline_gbps: float
    netns: bool = False  # both figures crossed a namespace's veth pair instead of loopback

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps

    def to_json(self) -> dict[str, Any]:
        row = {**asdict(self), "ratio": self.ratio}
        if not self.netns:  # loopback rows keep the shape they always had
            del row["netns"]
        return row


@dataclass(slots=True)
class Route:
    """Where the prefill peer and the raw sender run: `host` is their address, `netns` their namespace."""

    netns: str | None = None
    host: str = LOOPBACK
    local_host: str = LOOPBACK  # this side's address on the way to `host`

    @property
    def backends(self) -> list[str]:
        return ["tcp"] if self.netns else ["shm", "tcp"]

    def describe(self, peer_metadata: dict[str, Any]) -> dict[str, str] | None:
        if self.netns is None:
            return None
        tcp = peer_metadata["backends"]["tcp"]
        return {"namespace": self.netns, "peer_tcp": f"{tcp['host']}:{tcp['port']}", "from": self.local_host,
                "path": "veth pair + bridge"}


@dataclass(slots=True)
class TransferBenchReport:
    layers: int
    block_kb: int
    repeats: int
    rows: list[TransferRow] = field(default_factory=list)
    netns: dict[str, str] | None = None  # the route, with --netns

    def meets_targets(self) -> dict[str, bool]:
        big = [r for r in self.rows if r.size_mb >= TARGET_MIN_MB and r.case == "contiguous"]
        measured = {r.backend for r in self.rows}
        return {f"{b}_contiguous_at_least_0.6x_{base}": all(r.ratio >= TARGET_RATIO for r in big if r.backend == b)
                for b, base in (("shm", "memcpy"), ("tcp", "raw_socket")) if b in measured}

    def to_json(self) -> dict[str, Any]:
        report = {"layers": self.layers, "block_kb": self.block_kb, "repeats": self.repeats,
                  "rows": [r.to_json() for r in self.rows], "targets": self.meets_targets()}
        return report if self.netns is None else {**report, "netns": self.netns}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", default="1,4,16,64,256", help="block-set sizes, comma separated")
    parser.add_argument("--block-kb", type=int, default=16, help="bytes of one block's K (or V) per layer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per figure (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")
    parser.add_argument("--netns", action="store_true",
                        help="tcp only, peer in a network namespace across a veth pair (needs root and iproute2)")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.sizes_mb).split(",") if s.strip()]
    if not sizes or min(sizes) <= 0 or min(args.block_kb, args.layers, args.repeats) <= 0:
        raise ValueError("--sizes-mb, --block-kb, --layers and --repeats must be positive")
    if any(s * 1024 % (args.block_kb * 2 * args.layers) for s in sizes):
        raise ValueError("each size must hold a whole number of blocks (block-kb * 2 * layers)")
    report = _measure_across_netns(sizes, args) if args.netns else asyncio.run(measure(sizes, args, Route()))
    if report is None:
        return 2
    render_table(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


def _measure_across_netns(sizes: list[int], args: argparse.Namespace) -> TransferBenchReport | None:
    """`measure` with the peer in a fresh namespace, deleted however the run ends; None: none could be made."""
    from tokenmill.runtime.netns import Hosts, netns_unavailable

    reason = netns_unavailable()
    if reason is None:
        try:
            hosts = Hosts(1)
        except RuntimeError as exc:
            reason = str(exc)
    if reason is not None:
        log.error("bench transfer --netns: %s", reason)
        return None
    try:
        return asyncio.run(measure(sizes, args, Route(hosts.names[0], hosts.address(1), hosts.bridge_address)))
    finally:
        hosts.close()


async def measure(sizes: list[int], args: argparse.Namespace, route: Route) -> TransferBenchReport:
    import torch

    from tokenmill.transfer import KVLayout, TransferAgent, allocate_shared_tensor
    from tokenmill.transfer.peer_process import PeerProcess, PeerSpec

    block_bytes = args.block_kb * 1024
    pool_blocks = 2 * max(sizes) * (1 << 20) // (block_bytes * 2 * args.layers)  # room for scattered sets
    layout = KVLayout(args.layers, pool_blocks, BLOCK_TOKENS, 1, block_bytes // (BLOCK_TOKENS * 2), "bfloat16")
    report = TransferBenchReport(args.layers, args.block_kb, args.repeats)
    rng = random.Random(args.seed)
    local = allocate_shared_tensor(layout.shape, torch.bfloat16)
    local.tensor.view(torch.uint8).fill_(1)  # fault the pages in, as a live KV pool would be
    spec = PeerSpec("bench-prefill", layout.total_bytes, route.backends, args.seed, netns=route.netns,
                    tcp_host=route.host if route.netns else None)
    try:
        with PeerProcess(spec) as peer:
            async with TransferAgent("bench-decode", route.backends) as agent:
                agent.register(local.region("kv"))
                agent.add_remote(peer.metadata)
                report.netns = route.describe(peer.metadata)
                for size_mb in sizes:
                    await _measure_size(report, agent, peer, layout, route, rng, size_mb)
    finally:
        local.close()
    return report


async def _measure_size(report: TransferBenchReport, agent: Any, peer: Any, layout: Any, route: Route,
                        rng: random.Random, size_mb: int) -> None:
    nbytes, repeats = size_mb << 20, report.repeats
    baselines = {"shm": ("memcpy", memcpy_gbps(nbytes, repeats))} if "shm" in route.backends else {}
    socket_gbps = await asyncio.to_thread(raw_socket_gbps, nbytes, repeats, route.netns, route.host)
    baselines["tcp"] = ("raw_socket", socket_gbps)
    for case in ("contiguous", "scattered"):
        src_ids, dst_ids = _block_ids(rng, case, nbytes // layout.bytes_per_block, layout.num_blocks)
        for backend in route.backends:
            descs, gbps = await _agent_gbps(agent, peer, layout, src_ids, dst_ids, backend, repeats)
            report.rows.append(TransferRow(size_mb, backend, case, descs, gbps, *baselines[backend],
                                           netns=route.netns is not None))
            log.info("%4d MB %-10s %s: %.2f GB/s", size_mb, case, backend, gbps)


def _block_ids(rng: random.Random, case: str, count: int, pool_blocks: int) -> tuple[list[int], list[int]]:
    if case == "contiguous":
        return list(range(count)), list(range(pool_blocks - count, pool_blocks))
    return rng.sample(range(pool_blocks), count), rng.sample(range(pool_blocks), count)


async def _agent_gbps(agent: Any, peer: Any, layout: Any, src_ids: list[int], dst_ids: list[int],
                      backend: str, repeats: int) -> tuple[int, float]:
    from tokenmill.transfer import TransferStatus, coalesce_pairs, kv_pair_descriptors, total_bytes
    from tokenmill.transfer.descriptors import encode_descriptors
    from tokenmill.transfer.peer_process import POOL_REGION

    src, dst = kv_pair_descriptors(layout, POOL_REGION, src_ids, layout, "kv", dst_ids)
    expected = (await peer.call_async("checksum", descs=encode_descriptors(src)))["checksum"]
    check = agent.read(peer.spec.name, src, dst, expected_checksum=expected, backend=backend)
    if await check.wait() is not TransferStatus.DONE:
        raise RuntimeError(f"{backend} transfer failed verification: {check.reason}")
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        handle = agent.read(peer.spec.name, src, dst, backend=backend)
        if await handle.wait() is not TransferStatus.DONE:
            raise RuntimeError(f"{backend} transfer failed: {handle.reason}")
        samples.append(time.perf_counter() - started)
    return len(coalesce_pairs(src, dst)[0]), total_bytes(src) / statistics.median(samples) / 1e9


def render_table(report: TransferBenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    route = "" if report.netns is None else (f", {report.netns['from']} -> {report.netns['peer_tcp']} across "
                                             f"netns {report.netns['namespace']}'s veth pair")
    table = Table(title=f"tokenmill bench transfer — {report.layers} layers, {report.block_kb} KB per block "
                        f"and layer (K or V), median of {report.repeats}, GB/s = 1e9 B/s{route}")
    for column in ("size", "backend", "case", "descriptors", "GB/s", "baseline GB/s", "ratio"):
        table.add_column(column, justify="left" if column in ("backend", "case") else "right")
    for r in report.rows:
        table.add_row(f"{r.size_mb} MB", f"{r.backend} netns" if r.netns else r.backend, r.case, f"{r.descriptors:,}",
                      f"{r.gbps:.2f}", f"{r.baseline.removeprefix('raw_')} {r.baseline_gbps:.2f}", f"{r.ratio:.2f}x")
    Console().print(table)
    for name, met in report.meets_targets().items():
        Console().print(f"target {name} (sizes >= {TARGET_MIN_MB} MB): {'met' if met else 'MISSED'}")
