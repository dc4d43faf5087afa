"""`tokenmill serve`'s supervisor of worker processes, with room to change the fleet at runtime.

`WorkerSupervisor` is the runtime `Supervisor` plus what the admin API needs: children added
while it runs (`add`), a say in whether an exited child comes back (`may_restart`, asked
before the supervisor's own restart budget), a word when an exit is settled (`on_settled`),
signals to one child, and the last lines each child wrote to stderr (`tail`), which are still
copied to this process's stderr as they come: the reason a start failed is in them.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from tokenmill.runtime.supervisor import ChildSpec, Supervisor, _Child, kill_leftovers

log = logging.getLogger(__name__)

TAIL_LINES = 20
TAIL_JOIN_S = 1.0  # how long an exit waits for the child's last stderr lines to be read


class WorkerSupervisor(Supervisor):
    def __init__(self, specs: list[ChildSpec], on_exit: Callable[[str], None] | None = None,
                 max_restarts: int = 5) -> None:
        super().__init__(specs, on_exit=on_exit, restart=True, max_restarts=max_restarts)
        self.may_restart: Callable[[str], bool] = lambda name: True
        self.on_settled: Callable[[str, int, bool], None] | None = None  # (name, exit code, restarted)
        self._tails: dict[str, deque[str]] = {}  # appended to by reader threads
        self._tails_lock = threading.Lock()
        self._readers: dict[str, threading.Thread] = {}

    def add(self, spec: ChildSpec) -> int:
        """Start one more child now; its pid."""
        if spec.name in self.children:
            raise ValueError(f"a child named {spec.name} is already running")
        self.specs.append(spec)
        self.children[spec.name] = _Child(spec, self._spawn(spec))
        return self.pid(spec.name)

    def send_signal(self, name: str, sig: signal.Signals) -> bool:
        child = self.children.get(name)
        if child is None or child.process.poll() is not None:
            return False
        child.process.send_signal(sig)
        return True

    def tail(self, name: str) -> list[str]:
        with self._tails_lock:
            return list(self._tails.get(name, ()))

    def _spawn(self, spec: ChildSpec) -> subprocess.Popen:
        log.info("starting %s", spec.name)
        process = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, start_new_session=True,
                                   stderr=subprocess.PIPE)
        tail = self._tails[spec.name] = deque(maxlen=TAIL_LINES)  # this incarnation's lines only
        reader = threading.Thread(target=_copy_lines, args=(process.stderr, tail, self._tails_lock), daemon=True,
                                  name=f"stderr-{spec.name}")
        reader.start()
        self._readers[spec.name] = reader
        return process

    def _handle_exit(self, child: _Child, code: int) -> None:
        name = child.spec.name
        kill_leftovers(child.process.pid)
        reader = self._readers.get(name)
        if reader is not None:
            reader.join(TAIL_JOIN_S)
        restart = (self.restart and not self._stopping and child.restarts < self.max_restarts
                   and self.may_restart(name))
        (log.error if code else log.info)("%s exited with code %s%s", name, code, "" if restart else "; not restarting")
        if self.on_exit is not None:
            self.on_exit(name)  # while its old pid is still on record
        if restart:
            child.restarts += 1
            child.process = self._spawn(child.spec)
            child.started_at = time.monotonic()
        else:
            del self.children[name]
        if self.on_settled is not None:
            self.on_settled(name, code, restart)


def _copy_lines(stream: IO[bytes], tail: deque[str], lock: threading.Lock) -> None:
    """Copy a child's stderr to ours line by line, keeping the last few."""
    with stream:
        for line in iter(stream.readline, b""):
            with lock:
                tail.append(line.decode("utf-8", errors="replace").rstrip())
            try:
                sys.stderr.buffer.write(line)
                sys.stderr.buffer.flush()
            except (OSError, ValueError, AttributeError):  # AttributeError: a stderr without .buffer
                pass  # our stderr is gone; keep reading so the child never blocks on a full pipe
