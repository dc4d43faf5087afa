"""The fleet of `tokenmill bench router-warmup`: mock workers filled with cached blocks, and what
they say they hold.

The workers are filled over their own request plane, with the `generate` frames a frontend
sends (one output token each), from one ZeroMQ DEALER per worker: the real worker, engine,
block pool and KV events, without the HTTP and routing hop, so each worker gets exactly its
share and the bench knows which worker holds which prompt. Every frontend already connected
(the `tokenmill serve` one) indexes the blocks from the workers' KV events as usual.

Prompt (w, i) of worker w is a seeded random token list; its first block alone makes every
prompt's hash chain distinct, so each prefix is cached on exactly one worker.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import zmq

from tokenmill.kv.hashing import block_hashes
from tokenmill.runtime import protocol as p

log = logging.getLogger(__name__)

BLOCK_SIZE = 16
FIRST_TOKEN = 3  # below it: the tiny checkpoints' special tokens
REPLY_TIMEOUT_S = 60.0
FILL_PARAMS = {"max_tokens": 1, "ignore_eos": True, "temperature": 0.0}


@dataclass(slots=True, frozen=True)
class FillPlan:
    workers: int
    prompt_tokens: int
    prompts_per_worker: int
    vocab_size: int
    seed: int

    @classmethod
    def for_blocks(cls, blocks: int, workers: int, prompt_tokens: int, vocab_size: int, seed: int) -> FillPlan:
        """Enough whole prompts per worker for `blocks` cached blocks over the fleet."""
        per_prompt = prompt_tokens // BLOCK_SIZE
        return cls(workers, prompt_tokens, max(1, -(-blocks // (workers * per_prompt))), vocab_size, seed)

    @property
    def blocks_per_worker(self) -> int:
        return self.prompts_per_worker * (self.prompt_tokens // BLOCK_SIZE)

    def prompt(self, worker: int, index: int) -> list[int]:
        rng = np.random.default_rng([self.seed, worker, index])
        return rng.integers(FIRST_TOKEN, self.vocab_size, self.prompt_tokens).tolist()


@dataclass(slots=True)
class WorkerLink:
    worker_id: str
    socket: zmq.Socket


@contextmanager
def links(entries: Sequence[dict]) -> Iterator[list[WorkerLink]]:
    """A DEALER to each registered worker (registry entries, sorted by worker id), closed on exit."""
    ctx = zmq.Context.instance()
    opened: list[WorkerLink] = []
    try:
        for entry in sorted(entries, key=lambda e: e["worker_id"]):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(entry["address"])
            opened.append(WorkerLink(entry["worker_id"], sock))
        yield opened
    finally:
        for link in opened:
            link.socket.close()


def _replies(sock: zmq.Socket) -> Iterator[dict]:
    """Every message queued on the socket now, batches unpacked."""
    while True:
        try:
            msg = p.unpack(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return
        yield from (msg.get("messages") or ()) if msg["type"] == p.BATCH else (msg,)


def fill(fleet: list[WorkerLink], plan: FillPlan, in_flight: int) -> None:
    """Send every worker its prompts, `in_flight` at a time, until all have finished."""
    sent, done = [0] * len(fleet), [0] * len(fleet)
    poller = zmq.Poller()
    for link in fleet:
        poller.register(link.socket, zmq.POLLIN)
    index = {link.socket: w for w, link in enumerate(fleet)}
    while min(done) < plan.prompts_per_worker:
        for w, link in enumerate(fleet):
            while sent[w] < plan.prompts_per_worker and sent[w] - done[w] < in_flight:
                link.socket.send(p.pack({"type": p.GENERATE, "request_id": f"fill-{w}-{sent[w]}",
                                         "prompt_token_ids": plan.prompt(w, sent[w]), "params": FILL_PARAMS}))
                sent[w] += 1
        ready = poller.poll(REPLY_TIMEOUT_S * 1000)
        if not ready:
            raise RuntimeError(f"the workers answered nothing for {REPLY_TIMEOUT_S:.0f} s during the fill")
        for sock, _ in ready:
            for msg in _replies(sock):
                if msg["type"] == p.ERROR:
                    raise RuntimeError(f"a fill request failed: {msg.get('code')}: {msg.get('message')}")
                done[index[sock]] += msg["type"] == p.TOKENS and bool(msg.get("finished"))


def snapshots(fleet: list[WorkerLink]) -> dict[str, set[int]]:
    """worker id -> the device block hashes it holds, from its own KV snapshot."""
    for link in fleet:
        link.socket.send(p.pack({"type": p.KV_SNAPSHOT}))
    held: dict[str, set[int]] = {}
    for link in fleet:
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while link.worker_id not in held:
            if not link.socket.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                raise RuntimeError(f"worker {link.worker_id} sent no KV snapshot within {REPLY_TIMEOUT_S:.0f} s")
            for msg in _replies(link.socket):  # heartbeats arrive too
                if msg["type"] == p.KV_SNAPSHOT:
                    held[link.worker_id] = set((msg.get("tiers") or {}).get("device") or ())
    return held


def misplaced_prefixes(plan: FillPlan, held: dict[str, set[int]], worker_ids: list[str], prefix_blocks: int,
                       hash_seed: int) -> int:
    """Prompts whose first `prefix_blocks` blocks are not on their own worker alone (0 when the
    fill did what the probes assume)."""
    wrong = 0
    for w, own in enumerate(worker_ids):
        for i in range(plan.prompts_per_worker):
            last = block_hashes(plan.prompt(w, i)[:prefix_blocks * BLOCK_SIZE], BLOCK_SIZE, hash_seed)[-1]
            wrong += last not in held[own] or any(last in held[o] for o in worker_ids if o != own)
    return wrong
