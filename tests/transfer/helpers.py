"""Test helpers: KV pools in shared memory, agent pairs, and a TCP proxy that injects faults."""
from __future__ import annotations

import asyncio
import copy
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenmill.transfer import KVLayout, SharedTensor, TransferAgent, allocate_shared_tensor

LAYOUT = KVLayout(num_layers=3, num_blocks=64, block_size=4, num_kv_heads=2, head_dim=16, dtype="bfloat16")


def random_pool(layout: KVLayout, seed: int) -> SharedTensor:
    pool = allocate_shared_tensor(layout.shape, getattr(torch, layout.dtype))
    raw = np.frombuffer(pool.shared.view, dtype=np.uint8)
    raw[:] = np.frombuffer(np.random.default_rng(seed).bytes(raw.size), dtype=np.uint8)
    return pool


def random_block_sets(rng: random.Random, num_blocks: int, count: int) -> tuple[list[int], list[int]]:
    """Source and destination ids: a mix of contiguous runs and scattered blocks."""
    start = rng.randrange(num_blocks - count // 2)
    src = list(range(start, min(num_blocks, start + count // 2)))
    src += rng.sample([b for b in range(num_blocks) if b not in src], count - len(src))
    dst = rng.sample(range(num_blocks), count)
    return src, dst


def blocks_bytes(pool: SharedTensor, block_ids: list[int]) -> bytes:
    """The raw bytes of blocks, [layers, 2, n, ...] (bit-exact, NaN-safe)."""
    return pool.tensor.view(torch.int16)[:, :, block_ids].contiguous().numpy().tobytes()


@dataclass(slots=True)
class AgentPair:
    prefill: TransferAgent
    decode: TransferAgent
    source: SharedTensor
    target: SharedTensor


@asynccontextmanager
async def agent_pair(seed: int = 0, backends: tuple[str, ...] = ("shm", "tcp")) -> AsyncIterator[AgentPair]:
    """Two started agents in this process, each with a KV pool registered as "kv"."""
    source, target = random_pool(LAYOUT, seed), allocate_shared_tensor(LAYOUT.shape, torch.bfloat16)
    prefill, decode = TransferAgent("prefill", backends), TransferAgent("decode", backends)
    try:
        await prefill.start()
        await decode.start()
        prefill.register(source.region("kv"))
        decode.register(target.region("kv"))
        decode.add_remote(prefill.metadata())
        prefill.add_remote(decode.metadata())
        yield AgentPair(prefill, decode, source, target)
    finally:
        await prefill.close()
        await decode.close()
        source.close()
        target.close()


class FaultyProxy:
    """Forwards TCP connections to `target`; on the way back (server → client) it can flip one
    byte, drop the connection, stall, or slow down, after a given number of bytes."""

    def __init__(self, target: tuple[str, int], *, flip_at: int | None = None, drop_after: int | None = None,
                 stall_after: int | None = None, delay_per_chunk: float = 0.0) -> None:
        self.target, self.flip_at, self.drop_after = target, flip_at, drop_after
        self.stall_after, self.delay_per_chunk = stall_after, delay_per_chunk
        self.forwarded = 0
        self.started_forwarding = asyncio.Event()
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def redirect(self, metadata: dict[str, Any], port: int) -> dict[str, Any]:
        """`metadata` with its tcp endpoint pointing at this proxy."""
        redirected = copy.deepcopy(metadata)
        redirected["backends"]["tcp"]["port"] = port
        return redirected

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
        if self._server is not None:
            self._server.close()

    async def _connect(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        server_reader, server_writer = await asyncio.open_connection(*self.target)
        self._writers += [client_writer, server_writer]
        upstream = asyncio.create_task(self._pump(client_reader, server_writer, faults=False))
        await self._pump(server_reader, client_writer, faults=True)
        upstream.cancel()
        server_writer.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, faults: bool) -> None:
        while chunk := await reader.read(64 << 10):
            keep_going = True
            if faults:
                chunk, keep_going = await self._apply_faults(bytearray(chunk))
            writer.write(chunk)
            await writer.drain()
            if not keep_going:
                break
        writer.close()

    async def _apply_faults(self, chunk: bytearray) -> tuple[bytearray, bool]:
        """The part of `chunk` to forward, and whether to keep the connection afterwards."""
        start, self.forwarded = self.forwarded, self.forwarded + len(chunk)
        self.started_forwarding.set()
        if self.flip_at is not None and start <= self.flip_at < self.forwarded:
            chunk[self.flip_at - start] ^= 0x01
        if self.drop_after is not None and self.forwarded > self.drop_after:
            return chunk[:max(0, self.drop_after - start)], False
        if self.stall_after is not None and self.forwarded > self.stall_after:
            await asyncio.Event().wait()  # hold the connection open, forward nothing more
        await asyncio.sleep(self.delay_per_chunk)
        return chunk, True


def run(coro: Any, limit_s: float = 60.0) -> Any:
    """asyncio.run with a ceiling, so a hung transfer fails its test instead of the whole run."""
    async def bounded() -> Any:
        return await asyncio.wait_for(coro, limit_s)

    return asyncio.run(bounded())
