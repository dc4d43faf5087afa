"""SocketReader: a plain zmq socket read from the event loop's reader callback, on uvloop and on
the default asyncio loop."""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

from tokenmill.runtime import event_loop
from tokenmill.runtime.zmq_reader import SocketReader

# Only a guard against a stall hanging the suite: the tests assert delivery, not speed.
_STALL_GUARD_S = 20.0

Runner = Callable[[Coroutine[Any, Any, Any]], Any]


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest) -> Runner:
    return event_loop.run if request.param == "uvloop" else asyncio.run


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    """A connected ROUTER (bound) / DEALER over ipc in tmp_path, with the ROUTER knowing the DEALER."""
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    for sock in (router, dealer):
        sock.setsockopt(zmq.LINGER, 0)
        # No high-water mark: a burst of 1,000 non-blocking sends must not hit Again while
        # zmq's I/O thread is still moving the first ones.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    dealer.setsockopt(zmq.IDENTITY, b"dealer")
    address = f"ipc://{tmp_path}/s"
    router.bind(address)
    dealer.connect(address)
    # Learn the route both ways before any test traffic (blocking, with a receive timeout).
    router.setsockopt(zmq.RCVTIMEO, int(_STALL_GUARD_S * 1000))
    dealer.setsockopt(zmq.RCVTIMEO, int(_STALL_GUARD_S * 1000))
    dealer.send(b"hello")
    assert router.recv_multipart() == [b"dealer", b"hello"]
    router.send_multipart([b"dealer", b"welcome"])
    assert dealer.recv_multipart() == [b"welcome"]
    yield router, dealer
    router.close()
    dealer.close()
    ctx.term()


async def _until(condition: Callable[[], bool]) -> None:
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0.001)

    await asyncio.wait_for(poll(), _STALL_GUARD_S)


def test_messages_queued_before_the_reader_exists_are_delivered(run: Runner,
                                                                pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair
    for i in range(5):
        dealer.send(b"early-%d" % i)
    # Wait until they are all queued at the router, so no edge is left to fire for them.
    assert router.poll(int(_STALL_GUARD_S * 1000), zmq.POLLIN)

    async def main() -> list[list[bytes]]:
        got: list[list[bytes]] = []
        reader = SocketReader(router, got.append)
        try:
            await _until(lambda: len(got) == 5)
        finally:
            reader.close()
        return got

    assert run(main()) == [[b"dealer", b"early-%d" % i] for i in range(5)]


def test_a_thousand_messages_arrive_all_and_in_order(run: Runner, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair

    async def main() -> list[bytes]:
        got: list[bytes] = []
        reader = SocketReader(router, lambda frames: got.append(frames[1]))
        try:
            for i in range(1000):
                dealer.send(i.to_bytes(4, "little"), flags=zmq.NOBLOCK)
                if i % 100 == 0:
                    await asyncio.sleep(0)  # let some be read while the rest are still being sent
            await _until(lambda: len(got) >= 1000)
            await asyncio.sleep(0.01)  # nothing extra (no duplicates) trails behind
        finally:
            reader.close()
        return got

    assert [int.from_bytes(b, "little") for b in run(main())] == list(range(1000))


def test_a_failing_callback_does_not_stop_the_others(run: Runner, pair: tuple[zmq.Socket, zmq.Socket],
                                                     caplog: pytest.LogCaptureFixture) -> None:
    router, dealer = pair

    async def main() -> list[bytes]:
        got: list[bytes] = []

        def on_message(frames: list[bytes]) -> None:
            if frames[1] == b"3":
                raise RuntimeError("bad message")
            got.append(frames[1])

        reader = SocketReader(router, on_message)
        try:
            for i in range(8):
                dealer.send(str(i).encode())
            await _until(lambda: len(got) == 7)
        finally:
            reader.close()
        return got

    with caplog.at_level(logging.ERROR, logger="tokenmill.runtime.zmq_reader"):
        assert run(main()) == [b"0", b"1", b"2", b"4", b"5", b"6", b"7"]
    assert [r.exc_info[0] for r in caplog.records if r.exc_info] == [RuntimeError]


class _Player:
    """One end of a rally: returns every ball with n + 1 until `rounds`. As the worker and the
    frontend do, it replies from a later loop callback (`_flush`), not from inside the reader's
    callback, so the send (which processes zmq's pending commands and so consumes the edge an
    arrival raised) happens where no drain follows it, unless the sender pokes."""

    def __init__(self, socket: zmq.Socket, peer: bytes | None, rounds: int) -> None:
        self.socket, self.peer, self.rounds = socket, peer, rounds
        self.seen: list[tuple[bytes, int]] = []
        self._outbox: list[bytes] = []
        self.reader = SocketReader(socket, self._on_message)

    def serve(self, ball: bytes) -> None:
        if not self._outbox:
            asyncio.get_running_loop().call_soon(self._flush)
        self._outbox.append(ball)

    def _on_message(self, frames: list[bytes]) -> None:
        ball = frames[-1]
        rally, n = ball[:1], int(ball[1:])
        self.seen.append((rally, n))
        if n < self.rounds:
            self.serve(rally + str(n + 1).encode())

    def _flush(self) -> None:
        balls, self._outbox = self._outbox, []
        for ball in balls:
            frames = [ball] if self.peer is None else [self.peer, ball]
            self.socket.send_multipart(frames, flags=zmq.NOBLOCK)
        self.reader.poke()


def test_ping_pong_both_ways_while_both_send_does_not_stall(run: Runner,
                                                            pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    """Two rallies at once, one served by each side, so each side both replies and receives
    replies; each send may consume the edge of a message that has just arrived."""
    router_socket, dealer_socket = pair
    rounds = 200

    async def main() -> tuple[_Player, _Player]:
        router, dealer = _Player(router_socket, b"dealer", rounds), _Player(dealer_socket, None, rounds)
        try:
            dealer.serve(b"d0")
            router.serve(b"r0")
            await _until(lambda: (b"d", rounds) in router.seen and (b"r", rounds) in dealer.seen)
            await asyncio.sleep(0.01)  # nothing extra trails behind
        finally:
            router.reader.close()
            dealer.reader.close()
        return router, dealer

    router, dealer = run(main())
    # Each side saw every other ball of both rallies, in order: the even balls of the rally its
    # peer served and the odd balls of its own.
    for player, peer_rally, own_rally in ((router, b"d", b"r"), (dealer, b"r", b"d")):
        assert [n for rally, n in player.seen if rally == peer_rally] == list(range(0, rounds + 1, 2))
        assert [n for rally, n in player.seen if rally == own_rally] == list(range(1, rounds, 2))


def test_close_stops_delivery(run: Runner, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair

    async def main() -> tuple[list[bytes], int]:
        got: list[bytes] = []
        reader = SocketReader(router, lambda frames: got.append(frames[1]))
        dealer.send(b"before")
        await _until(lambda: got == [b"before"])
        reader.close()
        for i in range(5):
            dealer.send(b"after-%d" % i)
        await asyncio.sleep(0.05)
        # Still queued at the socket, not lost: the reader just stopped taking them.
        left = 0
        while router.poll(1000 if left < 5 else 0, zmq.POLLIN):
            router.recv_multipart(zmq.NOBLOCK)
            left += 1
        return got, left

    assert run(main()) == ([b"before"], 5)


def test_close_also_stops_a_drain_already_scheduled(run: Runner, pair: tuple[zmq.Socket, zmq.Socket]) -> None:
    router, dealer = pair
    dealer.send(b"queued")
    assert router.poll(int(_STALL_GUARD_S * 1000), zmq.POLLIN)

    async def main() -> list[list[bytes]]:
        got: list[list[bytes]] = []
        reader = SocketReader(router, got.append)  # schedules its first drain
        reader.close()
        reader.poke()  # a sender that still holds the reader (the worker's _send_now does)
        await asyncio.sleep(0.05)
        return got

    assert run(main()) == []
