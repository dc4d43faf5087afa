"""The frontend's view of the workers: one DEALER connection each, kept in step with
discovery, with liveness from heartbeats, feeding the router.

A worker is dropped when discovery stops listing it or when nothing (heartbeat or
tokens) has arrived from it for `heartbeat_timeout_s`; every stream still open on
it then receives a `LOST` marker, so the request can be migrated. Workers that
publish KV events get a SUB socket too: events go to the router's index, and a
gap in event ids triggers a snapshot request answered on the DEALER socket. A worker met
mid-life is asked for its snapshot as it joins, unless `snapshot_on_join` is off (a cold start:
`--no-kv-snapshot-on-join`): its blocks then reach the index only with its first KV event,
whose id gap asks for the snapshot.

A draining worker (it says so in its heartbeats, or `mark_draining` was told so by the admin
API) stays connected, so the streams it holds finish, but is no longer offered for new requests
by `in_pool`; it is dropped like any other once it deregisters or exits.

Disaggregated deployments hold two routers: prefill workers (role "prefill") join
`prefill_router`, every other worker joins `router`; each worker's events and load feed the
router of its own pool.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

import zmq

from tokenmill.fleet.inbox import StreamInbox
from tokenmill.kv.events import event_from_wire
from tokenmill.router.indexer import ApplyStatus
from tokenmill.router.policies import Router
from tokenmill.runtime import protocol as p
from tokenmill.runtime.discovery import DEFAULT_TTL_S, Discovery, WorkerInfo
from tokenmill.runtime.zmq_reader import SocketReader

if TYPE_CHECKING:  # nats: only frontends given --event-plane
    from tokenmill.runtime.event_plane import NatsEventPlane

log = logging.getLogger(__name__)

LOST: dict[str, Any] = {"type": "worker_lost"}
STARTUP_POLL_S = 0.02


class WorkerConnection:
    def __init__(self, info: WorkerInfo, ctx: zmq.Context, router: Router,
                 event_plane: NatsEventPlane | None = None, snapshot_on_join: bool = True) -> None:
        self.info = info
        self.router = router
        self.socket = ctx.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(info.address)
        self.streams: dict[str, StreamInbox] = {}
        self._outbox: list[dict[str, Any]] = []
        self.last_seen = time.monotonic()
        self.load: dict[str, float] = dict(info.metadata)
        self.draining = bool(self.load.get("draining"))  # once set, never unset: a drain ends in an exit
        if "num_blocks" in info.metadata:
            router.report_capacity(info.worker_id, int(info.metadata["num_blocks"]))
        self._reader = SocketReader(self.socket, self._on_frames)
        self._events: SocketReader | None = None
        self._plane, self._subject = event_plane, info.metadata.get("events_subject")
        if self._subject and event_plane is not None and router.indexer is not None:
            event_plane.subscribe(self._subject, lambda frame: self._on_events([frame]))
        elif info.metadata.get("events_address") and router.indexer is not None:
            events = ctx.socket(zmq.SUB)
            events.setsockopt(zmq.LINGER, 0)
            events.setsockopt(zmq.SUBSCRIBE, b"")
            events.connect(info.metadata["events_address"])
            self._events = SocketReader(events, self._on_events)
        self.send({"type": p.HELLO})
        if snapshot_on_join and router.indexer is not None and (self._subject or self._events is not None):
            # a worker met mid-life: its blocks now, not as its next events trickle in
            self.send({"type": p.KV_SNAPSHOT})

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    def send(self, message: dict[str, Any]) -> None:
        """Queue a frame for the worker; what is queued in one loop iteration leaves as one
        message (`batch`). If it cannot leave (the worker's queue is full, the socket is gone),
        every generate in it gets `LOST` on its stream, so the request tries another worker;
        anything else lost (an abort, a release) the worker times out itself."""
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(message)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        frame = messages[0] if len(messages) == 1 else {"type": p.BATCH, "messages": messages}
        try:
            self.socket.send(p.pack(frame), flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %d frames to %s: %s", len(messages), self.worker_id, exc)
            for message in messages:
                inbox = self.streams.get(str(message.get("request_id"))) if message["type"] == p.GENERATE else None
                if inbox is not None:
                    inbox.put(LOST)
            return
        self._reader.poke()

    def open_stream(self, request_id: str) -> StreamInbox:
        inbox = self.streams[request_id] = StreamInbox()
        return inbox

    def close_stream(self, request_id: str) -> None:
        self.streams.pop(request_id, None)

    def close(self) -> None:
        self._reader.close()
        for inbox in self.streams.values():
            inbox.put(LOST)
        self.streams.clear()
        self.socket.close()
        if self._events is not None:
            self._events.close()
            self._events.socket.close()
        if self._plane is not None and self._subject:
            self._plane.unsubscribe(self._subject)

    def _on_frames(self, frames: list[bytes]) -> None:
        self.last_seen = time.monotonic()
        try:
            msg = p.unpack(frames[-1])
        except p.ProtocolError as exc:
            log.warning("worker %s sent a bad frame: %s", self.worker_id, exc)
            return
        kind = msg["type"]
        if kind == p.BATCH:
            for item in msg.get("messages") or ():
                self._to_stream(item)
        elif kind == p.HEARTBEAT:
            self._on_heartbeat(msg.get("load") or {})
        elif kind == p.KV_SNAPSHOT:
            self.router.apply_snapshot(self.worker_id, msg.get("tiers") or {}, int(msg["last_event_id"]))
        else:
            self._to_stream(msg)

    def _to_stream(self, msg: Any) -> None:
        inbox = self.streams.get(str(msg.get("request_id"))) if isinstance(msg, dict) else None
        if inbox is not None:
            inbox.put(msg)

    def _on_heartbeat(self, load: dict[str, float]) -> None:
        self.load.update(load)
        self.draining = self.draining or bool(load.get("draining"))
        if "num_blocks" in load:
            self.router.report_capacity(self.worker_id, int(load["num_blocks"]))
        if "others_prefill_blocks" in load:  # what this frontend did not route there
            self.router.report_load(self.worker_id, load["others_prefill_blocks"],
                                    load.get("others_decode_blocks", 0.0))

    def _on_events(self, frames: list[bytes]) -> None:
        try:
            msg = p.unpack(frames[-1])
            events = [event_from_wire(e) for e in msg.get("events") or []]
        except ValueError as exc:  # ProtocolError included: skip it, the id gap will show
            log.warning("worker %s sent bad KV events: %s", self.worker_id, exc)
            return
        for event in events:
            if self.router.apply_event(event) is ApplyStatus.GAP:
                self.send({"type": p.KV_SNAPSHOT})
                break


class WorkerPool:
    def __init__(self, discovery: Discovery, router: Router, heartbeat_timeout_s: float = DEFAULT_TTL_S,
                 poll_s: float = 0.2, prefill_router: Router | None = None,
                 event_plane: NatsEventPlane | None = None, snapshot_on_join: bool = True) -> None:
        self.discovery = discovery
        self.snapshot_on_join = snapshot_on_join
        self.event_plane = event_plane
        self.router = router
        self.prefill_router = prefill_router or Router(router.config)
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.poll_s = poll_s
        self.ctx = zmq.Context.instance()
        self.connections: dict[str, WorkerConnection] = {}
        self.join_messages: list[dict[str, Any]] = []  # sent to each worker as it joins (runtime settings)
        self._refused: set[str] = set()  # incarnations of workers whose block size is not the routers'
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.discovery.start()
        if self.event_plane is not None:
            self.event_plane.on_reconnect = self.resync
            await self.event_plane.start()
        self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for conn in list(self.connections.values()):
            conn.close()
        self.connections.clear()
        if self.event_plane is not None:
            await self.event_plane.close()
        await self.discovery.close()

    def resync(self) -> None:
        """The event plane is (back) up: frames may have been lost meanwhile with no later event to
        show the gap, so every worker sends a snapshot now."""
        for conn in self.connections.values():
            conn.send({"type": p.KV_SNAPSHOT})

    def router_for(self, role: str) -> Router:
        return self.prefill_router if role == "prefill" else self.router

    def hashing(self) -> tuple[int, int]:
        """Block size and hash seed the workers cache with (every worker of a deployment agrees)."""
        for conn in self.connections.values():
            return int(conn.info.metadata.get("block_size", 16)), int(conn.info.metadata.get("hash_seed", 0))
        return 16, 0

    def in_pool(self, prefill: bool) -> list[str]:
        """Live workers of the prefill pool, or of the decode/aggregated pool, that take new requests."""
        return [w for w, c in self.connections.items() if (c.info.role == "prefill") == prefill and not c.draining]

    def use_tiers(self, enabled: bool) -> None:
        """Every worker, and each that joins later, uses (or stops using) its KV tiers below the
        device pool; both routers weigh tier hits to match."""
        message = {"type": p.TIERS, "enabled": enabled}
        self.join_messages = [message]
        for conn in list(self.connections.values()):
            conn.send(message)
        for router in (self.router, self.prefill_router):
            router.use_tiers(enabled)

    def has_tiers(self) -> bool:
        """Some worker reports KV tiers below its device pool (its heartbeat has `tier_*` keys)."""
        return any(any(key.startswith("tier_") for key in conn.load) for conn in self.connections.values())

    def mark_draining(self, worker_id: str) -> bool:
        """Route nothing new to the worker from now on (its own heartbeat says so a moment later)."""
        conn = self.connections.get(worker_id)
        if conn is not None:
            conn.draining = True
        return conn is not None

    def drop(self, worker_id: str, reason: str) -> None:
        conn = self.connections.pop(worker_id, None)
        self.router.remove_worker(worker_id)
        self.prefill_router.remove_worker(worker_id)
        if conn is not None:
            log.warning("worker %s left (%s); %d requests to migrate", worker_id, reason, len(conn.streams))
            conn.close()

    def refresh(self) -> None:
        live = {w.worker_id: w for w in self.discovery.workers()}
        for worker_id, conn in list(self.connections.items()):
            info = live.get(worker_id)
            if info is None:
                self.drop(worker_id, "deregistered")
            elif info.incarnation != conn.info.incarnation:
                self.drop(worker_id, "restarted")
            elif time.monotonic() - conn.last_seen > self.heartbeat_timeout_s:
                self.drop(worker_id, "heartbeat timeout")
        for worker_id, info in live.items():
            if worker_id not in self.connections:
                router = self.router_for(info.role)
                if not self._hashes_alike(info, router):
                    continue
                self._warn_mixed_kernels(info)
                log.info("worker %s joined at %s", worker_id, info.address)
                router.add_worker(worker_id)
                conn = self.connections[worker_id] = WorkerConnection(info, self.ctx, router, self.event_plane,
                                                                      self.snapshot_on_join)
                for message in self.join_messages:
                    conn.send(message)

    def _hashes_alike(self, info: WorkerInfo, router: Router) -> bool:
        """A worker whose KV blocks are not the router's size is refused (said once per incarnation):
        the router would count its prompts in other blocks than the worker caches."""
        size = int(info.metadata.get("block_size", router.config.block_size))
        if size == router.config.block_size:
            return True
        if info.incarnation not in self._refused:
            self._refused.add(info.incarnation)
            log.error("worker %s caches blocks of %d tokens, this frontend's --block-size is %d: not routing to it",
                      info.worker_id, size, router.config.block_size)
        return False

    def _warn_mixed_kernels(self, info: WorkerInfo) -> None:
        """Said when a worker joins a fleet whose workers differ from it in --deterministic: a
        request migrated, or whose KV is pulled, between the two kinds may differ in its last bits
        from the same request served by either kind alone. Served all the same (a rolling change)."""
        mine = bool(info.metadata.get("deterministic", False))
        other = next((c.info for c in self.connections.values()
                      if bool(c.info.metadata.get("deterministic", False)) != mine), None)
        if other is not None:
            log.warning("worker %s runs %s --deterministic and worker %s %s: requests that move between them "
                        "are not replayed bit for bit", info.worker_id, "with" if mine else "without",
                        other.worker_id, "without" if mine else "with")

    async def _poll(self) -> None:
        while True:
            # while no worker has joined (start-up), look often: the first request waits on it
            await asyncio.sleep(self.poll_s if self.connections else min(self.poll_s, STARTUP_POLL_S))
            try:
                self.refresh()
            except OSError as exc:
                log.warning("discovery poll failed: %s", exc)


async def next_message(inbox: StreamInbox, deadline: float) -> dict[str, Any] | None:
    """The stream's next frame, or None once `deadline` (time.monotonic) has passed."""
    return await inbox.get(deadline)
