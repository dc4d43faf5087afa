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
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import random
import socket
import statistics
import struct
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TARGET_RATIO = 0.6
TARGET_MIN_MB = 16
BLOCK_TOKENS = 16
LENGTH = struct.Struct("<Q")


@dataclass(slots=True)
class TransferRow:
    size_mb: int
    backend: str
    case: str
    descriptors: int
    gbps: float
    baseline: str
    baseline_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.baseline_gbps


@dataclass(slots=True)
class TransferBenchReport:
    layers: int
    block_kb: int
    repeats: int
    rows: list[TransferRow] = field(default_factory=list)

    def meets_targets(self) -> dict[str, bool]:
        big = [r for r in self.rows if r.size_mb >= TARGET_MIN_MB and r.case == "contiguous"]
        return {f"{b}_contiguous_at_least_0.6x_{base}": all(r.ratio >= TARGET_RATIO for r in big if r.backend == b)
                for b, base in (("shm", "memcpy"), ("tcp", "raw_socket"))}

    def to_json(self) -> dict[str, Any]:
        rows = [{**asdict(r), "ratio": r.ratio} for r in self.rows]
        return {"layers": self.layers, "block_kb": self.block_kb, "repeats": self.repeats, "rows": rows,
                "targets": self.meets_targets()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", default="1,4,16,64,256", help="block-set sizes, comma separated")
    parser.add_argument("--block-kb", type=int, default=16, help="bytes of one block's K (or V) per layer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="timed transfers per figure (median)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.sizes_mb).split(",") if s.strip()]
    if not sizes or min(sizes) <= 0 or min(args.block_kb, args.layers, args.repeats) <= 0:
        raise ValueError("--sizes-mb, --block-kb, --layers and --repeats must be positive")
    if any(s * 1024 % (args.block_kb * 2 * args.layers) for s in sizes):
        raise ValueError("each size must hold a whole number of blocks (block-kb * 2 * layers)")
    report = asyncio.run(measure(sizes, args))
    render_table(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


async def measure(sizes: list[int], args: argparse.Namespace) -> TransferBenchReport:
    import torch

    from tokenmill.transfer import KVLayout, TransferAgent, allocate_shared_tensor
    from tokenmill.transfer.peer_process import PeerProcess, PeerSpec

    block_bytes = args.block_kb * 1024
    per_block = block_bytes * 2 * args.layers
    pool_blocks = 2 * max(sizes) * (1 << 20) // per_block  # room for scattered sets
    layout = KVLayout(args.layers, pool_blocks, BLOCK_TOKENS, 1, block_bytes // (BLOCK_TOKENS * 2), "bfloat16")
    report = TransferBenchReport(args.layers, args.block_kb, args.repeats)
    rng = random.Random(args.seed)
    local = allocate_shared_tensor(layout.shape, torch.bfloat16)
    local.tensor.view(torch.uint8).fill_(1)  # fault the pages in, as a live KV pool would be
    try:
        with PeerProcess(PeerSpec("bench-prefill", layout.total_bytes, seed=args.seed)) as peer:
            async with TransferAgent("bench-decode", ["shm", "tcp"]) as agent:
                agent.register(local.region("kv"))
                agent.add_remote(peer.metadata)
                for size_mb in sizes:
                    memcpy_gbps = _memcpy_gbps(size_mb << 20, args.repeats)
                    socket_gbps = await asyncio.to_thread(_raw_socket_gbps, size_mb << 20, args.repeats)
                    baselines = {"shm": ("memcpy", memcpy_gbps), "tcp": ("raw_socket", socket_gbps)}
                    for case in ("contiguous", "scattered"):
                        count = (size_mb << 20) // per_block
                        src_ids, dst_ids = _block_ids(rng, case, count, layout.num_blocks)
                        for backend in ("shm", "tcp"):
                            descs, gbps = await _agent_gbps(agent, peer, layout, src_ids, dst_ids, backend,
                                                            args.repeats)
                            report.rows.append(TransferRow(size_mb, backend, case, descs, gbps, *baselines[backend]))
                            log.info("%4d MB %-10s %s: %.2f GB/s", size_mb, case, backend, gbps)
    finally:
        local.close()
    return report


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


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    import numpy as np

    src, dst = np.ones(nbytes, dtype=np.uint8), np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # warm: both sides faulted in
    return nbytes / _median_seconds(lambda: np.copyto(dst, src), repeats) / 1e9


def _raw_socket_gbps(nbytes: int, repeats: int) -> float:
    """Plain sockets, another process: it `sendall`s `nbytes` per 8-byte request."""
    import numpy as np

    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    sender = context.Process(target=_raw_sender, args=(ports, nbytes), daemon=True)
    sender.start()
    try:
        with socket.create_connection(("127.0.0.1", ports.get(timeout=60))) as sock:
            view = memoryview(np.zeros(nbytes, dtype=np.uint8)).cast("B")

            def one() -> None:
                sock.sendall(LENGTH.pack(nbytes))
                got = 0
                while got < nbytes:
                    got += sock.recv_into(view[got:])

            one()  # warm
            return nbytes / _median_seconds(one, repeats) / 1e9
    finally:
        sender.join(30)


def _raw_sender(ports: Any, nbytes: int) -> None:
    payload = memoryview(bytearray(b"\x01" * nbytes))
    with socket.create_server(("127.0.0.1", 0)) as server:
        ports.put(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            while len(request := conn.recv(LENGTH.size)) == LENGTH.size:
                conn.sendall(payload[:LENGTH.unpack(request)[0]])


def _median_seconds(action: Callable[[], object], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def render_table(report: TransferBenchReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"tokenmill bench transfer — {report.layers} layers, {report.block_kb} KB per block "
                        f"and layer (K or V), median of {report.repeats}, GB/s = 1e9 B/s")
    for column in ("size", "backend", "case", "descriptors", "GB/s", "baseline GB/s", "ratio"):
        table.add_column(column, justify="left" if column in ("backend", "case") else "right")
    for r in report.rows:
        table.add_row(f"{r.size_mb} MB", r.backend, r.case, f"{r.descriptors:,}", f"{r.gbps:.2f}",
                      f"{r.baseline.removeprefix('raw_')} {r.baseline_gbps:.2f}", f"{r.ratio:.2f}x")
    Console().print(table)
    for name, met in report.meets_targets().items():
        Console().print(f"target {name} (sizes >= {TARGET_MIN_MB} MB): {'met' if met else 'MISSED'}")
