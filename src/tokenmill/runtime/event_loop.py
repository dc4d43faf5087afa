"""The event loop every tokenmill server process runs on: uvloop.

The frontend and the workers spend most of their CPU in the loop itself (socket callbacks,
task switches, timers); uvloop's libuv-based loop does that work in C, several times faster
than the default selector loop, and pyzmq's asyncio sockets work on it unchanged.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

import uvloop

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on a uvloop loop."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)
