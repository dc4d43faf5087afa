"""`tokenmill bench connector`: KV pulls through the vLLM connector's worker side, against plain
transfer-agent reads of the same bytes.

Two processes, as a prefill and a decode vLLM worker would be: a child holds a `WorkerSide` over
caches laid out as vLLM's CPU backend lays them out (`--layers` tensors of
`[blocks, kv_heads, block_size, 2*head]`, random bytes) and seals one request's blocks; this
process pulls block sets of each `--sizes-mb` into its own `WorkerSide` as a decode worker's
connector does (the KV, layer by layer, then the blocks' checksum rows, then each block verified),
timed from the job to its result, median of `--repeats`. Alternating with each pull, the same
bytes are read by the same agent with one `TransferAgent.read` and no verification: the tcp path
the own engine's transfers take (`tokenmill bench transfer` measures it against a raw socket).
Contiguous block ids on both sides. No vLLM is needed.

JSON (`--json OUT`): {"layers", "block_kb", "repeats", "rows": [{size_mb, blocks, connector_gbps,
agent_read_gbps, ratio}]}; GB/s are 1e9 bytes per second of KV (the checksum rows not counted).
"""
from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import statistics
import time
from pathlib import Path
from typing import Any

from tokenmill.transfer import Descriptor

log = logging.getLogger(__name__)

KV_HEADS, BLOCK_TOKENS = 4, 32
REQUEST = "bench-prefill-request"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes-mb", default="4,16,64,256", help="block-set sizes, comma separated")
    parser.add_argument("--block-kb", type=int, default=32, help="bytes of one block (K and V) per layer")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="timed pulls per figure (median)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.sizes_mb).split(",") if s.strip()]
    if not sizes or min(sizes) <= 0 or min(args.block_kb, args.layers, args.repeats) <= 0:
        raise ValueError("--sizes-mb, --block-kb, --layers and --repeats must be positive")
    shape = (KV_HEADS, BLOCK_TOKENS, 2 * args.block_kb)  # float32: block_kb KiB per block and layer
    num_blocks = max(sizes) * (1 << 20) // (args.block_kb * 1024 * args.layers) + 1  # block 0 stays unused
    report = {"layers": args.layers, "block_kb": args.block_kb, "repeats": args.repeats,
              "rows": measure(sizes, args, shape, num_blocks)}
    render(report)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def measure(sizes: list[int], args: argparse.Namespace, shape: tuple[int, ...], num_blocks: int) -> list[dict]:
    import asyncio

    from tokenmill.engines.vllm.connector_jobs import LoadJob

    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    prefill = context.Process(target=_prefill_side, args=(child, args.layers, num_blocks, shape), daemon=True)
    prefill.start()
    decode, caches = _worker_side("bench-decode", args.layers, num_blocks, shape, fill=0.0)
    loop = asyncio.new_event_loop()
    try:
        handle = parent.recv()
        reader = loop.run_until_complete(_reader(caches, handle["agent"]))
        rows = []
        for size_mb in sizes:
            blocks = size_mb * (1 << 20) // (args.block_kb * 1024 * args.layers)
            ids = list(range(1, blocks + 1))
            job = {**handle, "block_ids": ids, "num_tokens": blocks * BLOCK_TOKENS}
            descs = [Descriptor(f"kv{i}", b * args.block_kb * 1024, args.block_kb * 1024)
                     for b in ids for i in range(args.layers)]
            pulls, reads = [], []
            for i in range(args.repeats + 1):  # the first of each is a warm-up
                seconds = _timed_pull(decode, LoadJob(f"pull-{size_mb}-{i}", job, 0, ids))
                read = loop.run_until_complete(_timed_read(reader, handle["agent"]["name"], descs))
                if i:
                    pulls.append(seconds)
                    reads.append(read)
            nbytes = len(descs) * args.block_kb * 1024
            connector, agent_read = nbytes / statistics.median(pulls) / 1e9, nbytes / statistics.median(reads) / 1e9
            rows.append({"size_mb": size_mb, "blocks": blocks, "connector_gbps": round(connector, 3),
                         "agent_read_gbps": round(agent_read, 3), "ratio": round(connector / agent_read, 3)})
            log.info("%4d MB: connector %.2f GB/s, agent read %.2f GB/s", size_mb, connector, agent_read)
        loop.run_until_complete(reader.close())
        return rows
    finally:
        parent.send("stop")
        prefill.join(timeout=10)
        decode.close()
        loop.close()


def _worker_side(name: str, layers: int, num_blocks: int, shape: tuple[int, ...], fill: float | None) -> Any:
    import torch

    from tokenmill.engines.vllm.connector_worker import WorkerSide
    from tokenmill.transfer import TcpBackend

    caches = {f"layers.{i}": (torch.rand(num_blocks, *shape) if fill is None else torch.full((num_blocks, *shape), fill))
              for i in range(layers)}
    side = WorkerSide(name, [TcpBackend()], hold_timeout_s=3600.0, pull_timeout_s=120.0)
    side.register(caches)
    return side, caches


def _prefill_side(conn: Any, layers: int, num_blocks: int, shape: tuple[int, ...]) -> None:
    """The child: caches of random bytes, every block sealed for one request, its handle sent back."""
    from tokenmill.engines.vllm.connector_jobs import SealJob, StepJobs, stamp

    side, _ = _worker_side("bench-prefill", layers, num_blocks, shape, fill=None)
    side.seal(StepJobs(seals=[SealJob(REQUEST, list(range(num_blocks)))]))
    conn.send({"agent": side.agent.metadata(), "layout": side.layout, "remote_request_id": REQUEST,
               "stamp": stamp(REQUEST)})
    conn.recv()
    side.close()


def _timed_pull(decode: Any, job: Any) -> float:
    from tokenmill.engines.vllm.connector_jobs import StepJobs

    began = time.perf_counter()
    decode.start_loads(StepJobs(loads=[job]))
    while True:
        _, received, failed = decode.results()
        if job.request_id in received:
            if failed:
                raise RuntimeError(f"a benchmark pull failed: {failed}")
            return time.perf_counter() - began
        time.sleep(0.0002)


async def _reader(caches: dict[str, Any], peer: dict[str, Any]) -> Any:
    """A plain agent over the decode side's caches (regions named as the connector names them)."""
    from tokenmill.transfer import TcpBackend, TransferAgent, host_region

    agent = TransferAgent("bench-reader", [TcpBackend()])
    await agent.start()
    for i, cache in enumerate(caches.values()):
        agent.register(host_region(f"kv{i}", cache))
    agent.add_remote(peer)
    return agent


async def _timed_read(agent: Any, peer: str, descs: list[Any]) -> float:
    began = time.perf_counter()
    transfer = agent.read(peer, descs, descs)
    await transfer.wait()
    if not transfer.ok:
        raise RuntimeError(f"a benchmark read failed: {transfer.reason}")
    return time.perf_counter() - began


def render(report: dict[str, Any]) -> None:
    print(f"KV pulls, {report['layers']} layers x {report['block_kb']} KiB blocks, median of {report['repeats']}")
    print(f"{'size':>8} {'blocks':>7} {'connector':>11} {'agent read':>11} {'ratio':>6}")
    for row in report["rows"]:
        print(f"{row['size_mb']:>5} MB {row['blocks']:>7} {row['connector_gbps']:>7.2f} GB/s "
              f"{row['agent_read_gbps']:>6.2f} GB/s {row['ratio']:>6.2f}")
