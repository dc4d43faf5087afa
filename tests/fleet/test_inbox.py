"""StreamInbox: one request's frames, in order, with a deadline on each wait."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

from tokenmill.fleet.inbox import StreamInbox
from tokenmill.runtime import event_loop

Runner = Callable[[Coroutine[Any, Any, Any]], Any]
FAR = 60.0  # a deadline no test reaches (the awaited put comes long before)
# The loops' timers may fire up to about a millisecond before their time (uvloop keeps
# milliseconds); a wait that ends earlier than this before its deadline ended too early.
TIMER_GRAIN_S = 0.002


@pytest.fixture(params=["uvloop", "asyncio"])
def run(request: pytest.FixtureRequest) -> Runner:
    return event_loop.run if request.param == "uvloop" else asyncio.run


def _frame(n: int) -> dict[str, Any]:
    return {"type": "tokens", "n": n}


def test_frames_come_out_in_the_order_they_were_put(run: Runner) -> None:
    async def main() -> list[dict[str, Any] | None]:
        inbox = StreamInbox()
        for n in range(5):
            inbox.put(_frame(n))
        deadline = time.monotonic() + FAR
        return [await inbox.get(deadline) for _ in range(5)]

    assert run(main()) == [_frame(n) for n in range(5)]


def test_get_waits_for_the_next_put(run: Runner) -> None:
    async def main() -> tuple[bool, dict[str, Any] | None, list[dict[str, Any] | None]]:
        inbox = StreamInbox()
        waiting = asyncio.create_task(inbox.get(time.monotonic() + FAR))
        for _ in range(5):
            await asyncio.sleep(0)
        done_before_put = waiting.done()
        inbox.put(_frame(1))
        inbox.put(_frame(2))  # a second put while the first wake-up is pending is kept, not lost
        first = await waiting
        rest = [inbox.get_nowait(), inbox.get_nowait()]
        return done_before_put, first, rest

    assert run(main()) == (False, _frame(1), [_frame(2), None])


def test_get_returns_none_at_the_deadline_and_the_inbox_still_works(run: Runner) -> None:
    async def main() -> tuple[dict[str, Any] | None, float, float, dict[str, Any] | None]:
        inbox = StreamInbox()
        deadline = time.monotonic() + 0.02
        timed_out = await inbox.get(deadline)
        ended = time.monotonic()
        inbox.put(_frame(7))  # the expired wait left no stale waiter behind
        later = asyncio.create_task(inbox.get(time.monotonic() + FAR))
        return timed_out, deadline, ended, await later

    timed_out, deadline, ended, later = run(main())
    assert timed_out is None
    assert ended >= deadline - TIMER_GRAIN_S
    assert later == _frame(7)


def test_a_passed_deadline_still_returns_a_queued_frame(run: Runner) -> None:
    async def main() -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
        inbox = StreamInbox()
        inbox.put(_frame(1))
        past = time.monotonic() - 1.0
        return await inbox.get(past), await inbox.get(past)

    assert run(main()) == (_frame(1), None)


def test_a_cancelled_get_leaves_the_inbox_usable(run: Runner) -> None:
    async def main() -> dict[str, Any] | None:
        inbox = StreamInbox()
        waiting = asyncio.create_task(inbox.get(time.monotonic() + FAR))
        await asyncio.sleep(0)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        inbox.put(_frame(3))  # no error setting a result on the cancelled waiter
        return await inbox.get(time.monotonic() + FAR)

    assert run(main()) == _frame(3)


def test_peek_looks_and_get_nowait_takes() -> None:
    inbox = StreamInbox()
    assert inbox.peek() is None and inbox.get_nowait() is None
    inbox.put(_frame(1))
    inbox.put(_frame(2))
    assert inbox.peek() == _frame(1)
    assert inbox.peek() == _frame(1)  # peeking takes nothing
    assert inbox.get_nowait() == _frame(1)
    assert inbox.peek() == _frame(2)
    assert inbox.get_nowait() == _frame(2)
    assert inbox.peek() is None and inbox.get_nowait() is None
