"""One worker process: an engine behind a ZeroMQ ROUTER socket.

Frontends connect DEALER sockets and send `hello`, `generate` and `abort` frames;
the worker streams `tokens` frames back and sends every known peer a `heartbeat`
(with its load) twice a second, so a frontend notices a dead worker quickly even
without a shared registry. A generate beyond the queue limit is answered with an
`overloaded` error, a bad one with `invalid_request`. The request-scoped frames one loop
iteration produces for a peer (an engine step's tokens) leave as one `batch`; each peer's
heartbeat also says what the worker holds for the *other* peers' requests, which is what
that frontend's router adds to its own books (router/load.py).

Roles (ARCHITECTURE.md "Processes at run time"): `agg` prefills and decodes; `prefill` and `decode` also run a
`KVTransferService`, so a prefill-only generate is answered with a KV transfer handle and a
generate carrying a handle pulls the prompt's KV instead of computing it. Any role still serves
plain generates (conditional disaggregation prefills short prompts on the decode worker).
Stopping (SIGTERM) drains briefly: the worker leaves discovery, refuses new work, and lets its
prefill-only requests and held KV finish (acknowledged or timed out) for up to `drain_timeout_s`,
then aborts what is left. `drain()` (SIGUSR1, from `tokenmill serve`'s admin API) is the graceful
kind: the worker stays registered but says `draining` in every heartbeat (frontends route nothing
new to it), refuses new work, lets every request it holds finish normally and its held KV be
pulled, and only then stops.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill.engine.stats import EngineStats
from tokenmill.engines.adapter import EngineAdapter
from tokenmill.runtime import protocol as p
from tokenmill.runtime.discovery import Discovery, WorkerInfo
from tokenmill.runtime.zmq_reader import SocketReader
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_HANDOFF, RequestOutput
from tokenmill.worker.kv_publisher import KVEventPublisher
from tokenmill.worker.settings import WorkerSettings, advertised

if TYPE_CHECKING:  # torch: only prefill/decode workers move KV; nats: only with --event-plane
    from tokenmill.runtime.event_plane import NatsEventPlane
    from tokenmill.worker.kv_transfer import KVTransferService

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.5
DRAIN_POLL_S = 0.05
# after a graceful drain's last request: its final frames leave before the socket closes (LINGER 0)
DRAIN_FLUSH_S = 0.25
STATS_WAIT_S = 0.1  # how long a heartbeat waits for the engine thread's fresh stats
class WorkerServer:
    def __init__(self, engine: EngineAdapter, settings: WorkerSettings, discovery: Discovery,
                 transfer: KVTransferService | None = None, event_plane: NatsEventPlane | None = None) -> None:
        self.engine = engine
        self.transfer = transfer
        self.settings = settings
        self.discovery = discovery
        self.ctx = zmq.Context.instance()
        self.socket = self.ctx.socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.peers: set[bytes] = set()
        self._reader: SocketReader | None = None
        # request-scoped frames per peer, sent as one `batch` when the loop iteration ends
        self._outbox: dict[bytes, list[dict]] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.peer_of: dict[str, bytes] = {}  # request id -> the frontend that sent it
        self.prefill_only: set[str] = set()  # ids in `tasks` that end with a KV handle
        self.requests_served = 0
        self.draining = False
        self.registered = False
        self.tiers_enabled = True  # the managed cache: turned off and on by the admin API (p.TIERS)
        self._drain_task: asyncio.Task | None = None
        self._stopping = asyncio.Event()
        self.event_plane = event_plane
        self.publisher: KVEventPublisher | None = None
        if event_plane is not None:
            from tokenmill.runtime.event_plane import kv_subject

            self.publisher = KVEventPublisher(engine, settings.worker_id, plane=event_plane,
                                              subject=kv_subject(settings.model_name, settings.worker_id))
        elif settings.events_address:
            self.publisher = KVEventPublisher(engine, settings.worker_id, settings.events_address)

    def bind(self) -> str:
        address = self.settings.address
        if address.endswith(":0"):
            port = self.socket.bind_to_random_port(address.rsplit(":", 1)[0])
            address = f"{address.rsplit(':', 1)[0]}:{port}"
        else:
            self.socket.bind(address)
        self.settings.address = advertised(address, self.settings.advertise_host)
        return self.settings.address

    async def serve(self) -> None:
        await self.engine.start()
        if self.transfer is not None:
            await self.transfer.start(self.engine)
        if self.event_plane is not None:
            await self.event_plane.start()
        if self.publisher is not None:
            self.publisher.start()
        await self.discovery.start()
        self.discovery.register(self._info())
        self.registered = True
        heartbeat = asyncio.create_task(self._heartbeat_loop())
        self._reader = SocketReader(self.socket, self._on_frames)
        try:
            await self._stopping.wait()
            self.discovery.unregister(self.settings.worker_id)
            await self._drain()
        finally:
            self._reader.close()
            heartbeat.cancel()
            if self._drain_task is not None:
                self._drain_task.cancel()
            self.discovery.unregister(self.settings.worker_id)
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
            if self.transfer is not None:
                await self.transfer.close()
            await self.engine.stop()
            self.socket.close()
            if self.publisher is not None:
                self.publisher.close()
            if self.event_plane is not None:
                await self.event_plane.close()
            await self.discovery.close()

    def stop(self) -> None:
        self._stopping.set()

    def ready(self) -> bool:
        """Takes new requests: registered, its engine stepping, neither draining nor stopping (read
        from the health endpoint's thread: plain attribute reads)."""
        return self.registered and not self.draining and not self._stopping.is_set() and self.engine.is_running()

    def drain(self) -> None:
        """Finish everything held, take nothing new, then stop (the graceful drain: never aborts)."""
        if self.draining or self._stopping.is_set():
            return
        self.draining = True
        log.info("draining: %d requests in flight", len(self.tasks))
        # tell the frontends now, not at the next beat: they stop routing here at once
        flag = {"draining": 1.0, "in_flight": len(self.tasks)}
        self.discovery.heartbeat(self.settings.worker_id, flag)
        for peer in list(self.peers):
            self._send_now(peer, {"type": p.HEARTBEAT, "worker_id": self.settings.worker_id, "load": flag})
        self._drain_task = asyncio.create_task(self._finish_then_stop())

    async def _finish_then_stop(self) -> None:
        while self.tasks or (self.transfer is not None and await self.transfer.num_held()):
            await asyncio.sleep(DRAIN_POLL_S)
        await asyncio.sleep(DRAIN_FLUSH_S)
        log.info("drained: %d requests served; stopping", self.requests_served)
        self.stop()

    async def _drain(self) -> None:
        """Let prefill-only requests finish and held KV be pulled; refuse new work meanwhile."""
        self.draining = True
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while time.monotonic() < deadline:
            held = await self.transfer.num_held() if self.transfer is not None else 0
            if not self.prefill_only and not held:
                return
            await asyncio.sleep(0.05)
        log.warning("stopping with %d prefill requests and KV still held", len(self.prefill_only))

    def _info(self) -> WorkerInfo:
        info = self.engine.info
        return WorkerInfo(
            worker_id=self.settings.worker_id, address=self.settings.address, role=self.settings.role,
            model=self.settings.model_name, pid=os.getpid(), host=os.uname().nodename,
            incarnation=uuid.uuid4().hex,
            metadata={"max_model_len": info.max_model_len, "block_size": info.block_size,
                      "hash_seed": info.hash_seed, "engine": info.name, "deterministic": info.deterministic,
                      "events_address": (advertised(self.publisher.address, self.settings.advertise_host)
                                         if self.publisher and self.publisher.address else None),
                      "events_subject": self.publisher.subject if self.publisher else None,
                      **self._load(self.engine.idle_stats())},
        )

    def _load(self, stats: EngineStats) -> dict[str, float]:
        return {"num_running": stats.num_running, "num_waiting": stats.num_waiting,
                "kv_usage": stats.kv_usage, "prefix_hit_rate": stats.prefix_hit_rate,
                "prefill_blocks": stats.prefill_blocks, "decode_blocks": stats.decode_blocks,
                "in_flight": len(self.tasks), "requests_served": self.requests_served,
                "draining": float(self.draining),
                "frontends": len(self.peers),
                "prefill_tokens": stats.prefill_tokens, "onboarded_tokens": stats.onboarded_tokens,
                "queried_tokens": stats.queried_tokens, "device_hit_tokens": stats.device_hit_tokens,
                "num_held": stats.num_held, "num_importing": stats.num_importing,
                "spec_draft_tokens": stats.spec_draft_tokens, "spec_accepted_tokens": stats.spec_accepted_tokens,
                **({"busy_seconds": stats.busy_seconds} if stats.busy_seconds else {}),  # (vLLM's steps are untimed)
                "num_free_blocks": stats.num_free_blocks, "num_blocks": stats.num_blocks,
                **(self.transfer.load() if self.transfer is not None else {}),
                **_tier_load(stats.tier_stats),
                **({"tiers_enabled": float(self.tiers_enabled)} if stats.tier_stats else {})}

    def _on_frames(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            self._dispatch(frames[0], frames[1])

    def _dispatch(self, peer: bytes, frame: bytes) -> None:
        self.peers.add(peer)
        try:
            msg = p.unpack(frame)
        except p.ProtocolError as exc:
            log.warning("dropping frame from %r: %s", peer, exc)
            return
        if msg["type"] != p.BATCH:
            self._handle(peer, msg)
            return
        for item in msg.get("messages") or ():
            if isinstance(item, dict) and isinstance(item.get("type"), str):
                self._handle(peer, item)
            else:
                log.warning("dropping a malformed message in a batch from %r", peer)

    def _handle(self, peer: bytes, msg: dict) -> None:
        kind = msg["type"]
        if kind == p.GENERATE:
            self._start_generate(peer, msg)
        elif kind == p.ABORT:
            request_id = str(msg.get("request_id"))
            task = self.tasks.get(request_id)
            if task is not None:
                task.cancel()
            elif self.transfer is not None:  # the client left after its prefill: drop the held KV
                asyncio.create_task(self.transfer.release(request_id, "aborted"))
        elif kind == p.KV_SNAPSHOT and self.publisher is not None:
            asyncio.create_task(self._send_snapshot(peer))
        elif kind == p.PIN:
            asyncio.create_task(self._pin(peer, msg))
        elif kind == p.TIERS:
            asyncio.create_task(self._set_tiers(bool(msg.get("enabled"))))

    async def _set_tiers(self, enabled: bool) -> None:
        """Admin: store to and load from the KV tiers, or not (a worker without tiers ignores it)."""
        if await self.engine.set_tiers_enabled(enabled):
            self.tiers_enabled = enabled
            log.info("KV tiers %s", "on" if enabled else "off")

    async def _pin(self, peer: bytes, msg: dict) -> None:
        """Admin: pin a prefix in this worker's KV tiers; a refusal is `ok: false` with the reason."""
        ok, error = False, None
        try:
            ok = await self.engine.pin_prefix(list(msg.get("prompt_token_ids") or []))
        except ValueError as exc:
            error = str(exc)
        self._send(peer, {"type": p.PINNED, "request_id": str(msg.get("request_id", "")), "ok": ok, "error": error})

    async def _send_snapshot(self, peer: bytes) -> None:
        if self.publisher is not None:
            self._send_now(peer, await self.publisher.snapshot())  # not request-scoped: never batched

    def _start_generate(self, peer: bytes, msg: dict) -> None:
        request_id = str(msg.get("request_id", ""))
        if not request_id or request_id in self.tasks:
            self._send(peer, p.error_message(request_id, p.INVALID_REQUEST, "request_id missing or in use"))
            return
        if self.draining:
            self._send(peer, p.error_message(request_id, p.OVERLOADED, "worker is shutting down"))
            return
        if (msg.get("prefill_only") or msg.get("kv_handle")) and self.transfer is None:
            self._send(peer, p.error_message(request_id, p.INVALID_REQUEST,
                                             f"a {self.settings.role} worker does not transfer KV"))
            return
        limit = self.settings.max_queue
        # Counted here, not from engine stats, which lag behind requests still being handed over.
        if limit is not None and len(self.tasks) >= self.engine.info.max_num_seqs + limit:
            self._send(peer, p.error_message(request_id, p.OVERLOADED, "worker queue is full"))
            return
        task = self.tasks[request_id] = asyncio.create_task(self._generate(peer, request_id, msg))
        self.peer_of[request_id] = peer
        # not a `finally` in _generate: a task cancelled before it first runs never enters it
        task.add_done_callback(lambda _: self._forget_task(request_id, task))
        if msg.get("prefill_only"):
            self.prefill_only.add(request_id)
        self.requests_served += 1

    async def _generate(self, peer: bytes, request_id: str, msg: dict) -> None:
        deadline = time.monotonic() + msg["timeout_s"] if msg.get("timeout_s") else None
        last: RequestOutput | None = None
        try:
            params = p.params_from_wire(msg.get("params"))
            stream = self.engine.generate(request_id, list(msg.get("prompt_token_ids") or []), params,
                                          msg.get("extra_key"), int(msg.get("output_offset") or 0),
                                          int(msg.get("text_pending") or 0),
                                          prefill_only=bool(msg.get("prefill_only")),
                                          kv_import=self._kv_import(msg.get("kv_handle")))
            async with asyncio.timeout_at(_loop_deadline(deadline)):
                async for out in stream:
                    last = out
                    handle = None
                    if out.finish_reason == FINISH_HANDOFF and self.transfer is not None:
                        handle = await self.transfer.handle_for(out)
                    self._send(peer, p.tokens_message(out, handle))
        except ValueError as exc:
            self._send(peer, p.error_message(request_id, p.INVALID_REQUEST, str(exc)))
        except (TimeoutError, asyncio.CancelledError):
            if last is not None and last.finish_reason == FINISH_HANDOFF and self.transfer is not None:
                asyncio.create_task(self.transfer.release(request_id, "aborted during the handoff"))
            self._send_abort(peer, request_id, last)
        except Exception as exc:  # an engine failure is this request's error, not the worker's death
            log.exception("request %s failed", request_id)
            self._send(peer, p.error_message(request_id, p.INTERNAL, f"worker error: {exc}"))

    def _forget_task(self, request_id: str, task: asyncio.Task) -> None:
        if self.tasks.get(request_id) is task:
            del self.tasks[request_id]
            self.peer_of.pop(request_id, None)
            self.prefill_only.discard(request_id)

    def _kv_import(self, handle: object) -> Any:
        """What the engine's generate takes for a prompt whose KV a prefill worker holds."""
        if self.transfer is None or handle is None:
            return None
        return self.transfer.kv_import(handle)

    def _send_abort(self, peer: bytes, request_id: str, last: RequestOutput | None) -> None:
        done = last.num_output_tokens if last else 0
        prompt = last.num_prompt_tokens if last else 0
        cached = last.num_cached_tokens if last else 0
        self._send(peer, p.tokens_message(RequestOutput(request_id, [], "", True, FINISH_ABORT, prompt, done, cached)))

    def _send(self, peer: bytes, message: dict) -> None:
        """Queue a request-scoped frame; every frame queued in one loop iteration (one engine
        step's tokens) leaves in one message per peer, in order."""
        queued = self._outbox.get(peer)
        if queued is None:
            if not self._outbox:
                asyncio.get_running_loop().call_soon(self._flush)
            queued = self._outbox[peer] = []
        queued.append(message)

    def _flush(self) -> None:
        outbox, self._outbox = self._outbox, {}
        for peer, messages in outbox.items():
            self._send_now(peer, messages[0] if len(messages) == 1 else {"type": p.BATCH, "messages": messages})

    def _send_now(self, peer: bytes, message: dict) -> None:
        try:
            self.socket.send_multipart([peer, p.pack(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # peer gone or its queue full: the frontend times out and retries
            log.debug("could not send to %r: %s", peer, exc)
        if self._reader is not None:
            self._reader.poke()

    async def _heartbeat_loop(self) -> None:
        """Beat every HEARTBEAT_INTERVAL_S whatever the engine is doing: its stats are read
        between steps, so during a long prefill step the beat carries the last known load
        (waiting for fresh stats would make a busy worker look dead)."""
        last = self.engine.idle_stats()
        load = self._load(last)
        stats: asyncio.Future[EngineStats] | None = None
        while True:
            if self.settings.parent_pid is not None and os.getppid() != self.settings.parent_pid:
                log.error("supervisor %d is gone; stopping", self.settings.parent_pid)
                self.stop()
            stats = stats if stats is not None and not stats.done() else asyncio.ensure_future(self.engine.stats())
            done, _ = await asyncio.wait({stats}, timeout=STATS_WAIT_S)
            if done and stats.exception() is None:
                last = stats.result()
                load = self._load(last)
            self.discovery.heartbeat(self.settings.worker_id, load)
            for peer in list(self.peers):
                beat = {"type": p.HEARTBEAT, "worker_id": self.settings.worker_id,
                        "load": {**load, **self._others_load(last, peer)}}
                self._send_now(peer, beat)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    def _others_load(self, stats: EngineStats, peer: bytes) -> dict[str, float]:
        """The blocks held for requests other frontends sent: each frontend's router keeps its own
        requests' books and adds only these (router/load.py)."""
        prefill = decode = 0
        for request_id, (p_blocks, d_blocks) in stats.request_blocks.items():
            if self.peer_of.get(request_id) != peer:
                prefill += p_blocks
                decode += d_blocks
        return {"others_prefill_blocks": prefill, "others_decode_blocks": decode}


def _tier_load(tier_stats: dict) -> dict[str, float]:
    if not tier_stats:  # no KV tiers: their module (and torch) stay unloaded
        return {}
    from tokenmill.engine.kv_tiers_wiring import tier_load

    return tier_load(tier_stats)


def _loop_deadline(deadline: float | None) -> float | None:
    """asyncio.timeout_at wants the event loop's clock; ours is time.monotonic, which it uses."""
    return None if deadline is None else asyncio.get_running_loop().time() + (deadline - time.monotonic())
