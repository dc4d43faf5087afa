"""A child's output held back until it writes one line, for a worker whose start is also the check
of its options: until it says they are accepted, nothing it writes reaches the user, so a refusal
can be told in one line; once it says so, what it held comes out in order and the rest passes on.

    gate = OutputGate(OPTIONS_ACCEPTED)
    gate.hold("stderr", line)   # True: held (or the line itself, which is dropped), False: pass it on
    gate.opened.wait(timeout)   # set once the line came; `held_lines("stderr")` until then
"""
from __future__ import annotations

import sys
import threading


class OutputGate:
    """Lines of a child's streams ("stdout", "stderr": this process's stream of that name) held
    until `opening_line` comes on one of them; then written out, in the order they came."""

    def __init__(self, opening_line: str) -> None:
        self.opening_line = opening_line.encode()
        self.opened = threading.Event()
        self._held: list[tuple[str, bytes]] = []
        self._lock = threading.Lock()  # one reader thread per stream

    def hold(self, stream: str, line: bytes) -> bool:
        """Whether `line` is kept from `stream` (the readers call this before passing a line on)."""
        if self.opened.is_set():  # set once, under the lock, after the held lines went out
            return False
        with self._lock:
            if self.opened.is_set():
                return False
            if not line.rstrip(b"\r\n").endswith(self.opening_line):  # (after a write that ended no line)
                self._held.append((stream, line))
                return True
            for held_stream, held_line in self._held:
                write_line(held_stream, held_line)
            self._held.clear()
            self.opened.set()
            return True

    def held_lines(self, stream: str) -> list[str]:
        with self._lock:
            return [line.decode("utf-8", errors="replace").rstrip() for name, line in self._held if name == stream]


def write_line(stream: str, line: bytes) -> None:
    """`line` to this process's stdout or stderr, as bytes."""
    try:
        target = getattr(sys, stream).buffer
        target.write(line)
        target.flush()
    except (OSError, ValueError, AttributeError):  # AttributeError: a stream without .buffer
        pass  # ours is gone; the reader keeps reading so that the child never blocks on a full pipe
