"""Process supervision for the embedded deployment: start children, restart the ones
that crash, stop them all on shutdown."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.runtime.shared_segments import group_members, mapped_segments, remove_once_unmapped

log = logging.getLogger(__name__)

# From SIGTERM to SIGKILL as the supervisor stops. A vLLM worker waits up to 5 s for its engine core
# to stop its own workers (3-4 s here), so a 5 s grace often cut it short, and the SIGKILL left
# vLLM's shared-memory queues behind.
STOP_GRACE_S = 10.0


@dataclass(slots=True)
class ChildSpec:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class _Child:
    spec: ChildSpec
    process: subprocess.Popen
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


class Supervisor:
    """Keeps one process per spec running; `on_exit(name)` is told the moment one dies."""

    def __init__(self, specs: list[ChildSpec], on_exit: Callable[[str], None] | None = None,
                 restart: bool = True, max_restarts: int = 5) -> None:
        self.specs = specs
        self.on_exit = on_exit
        self.restart = restart
        self.max_restarts = max_restarts
        self.children: dict[str, _Child] = {}
        self._stopping = False

    def start(self) -> None:
        """Every spec not started yet."""
        for spec in self.specs:
            if spec.name not in self.children:
                self.children[spec.name] = _Child(spec, self._spawn(spec))

    def pid(self, name: str) -> int:
        return self.children[name].process.pid

    async def watch(self, interval_s: float = 0.1) -> None:
        while not self._stopping:
            for child in list(self.children.values()):
                code = child.process.poll()
                if code is not None and not self._stopping:
                    self._handle_exit(child, code)
            await asyncio.sleep(interval_s)

    def _handle_exit(self, child: _Child, code: int) -> None:
        name = child.spec.name
        kill_leftovers(child.process.pid)
        log.error("%s exited with code %s", name, code)
        if self.on_exit is not None:
            self.on_exit(name)
        if not self.restart or child.restarts >= self.max_restarts:
            log.error("%s will not be restarted (%d restarts so far)", name, child.restarts)
            del self.children[name]
            return
        child.restarts += 1
        child.process = self._spawn(child.spec)
        child.started_at = time.monotonic()

    def stop(self, timeout_s: float = STOP_GRACE_S) -> None:
        """SIGTERM every child, then SIGKILL whatever is still alive after `timeout_s`."""
        self._stopping = True
        for child in self.children.values():
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in self.children.values():
            try:
                child.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.spec.name)
                child.process.kill()
                child.process.wait()
            kill_leftovers(child.process.pid)

    @staticmethod
    def _spawn(spec: ChildSpec) -> subprocess.Popen:
        log.info("starting %s", spec.name)
        return subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, start_new_session=True)


def kill_leftovers(pid: int) -> None:
    """What an exited child started and left behind (an outside engine's processes, such as vLLM's
    engine core, outlive a killed parent): the rest of its session's process group, led by its pid
    (a pid is not reused while a group of that id has members), and the shared-memory segments
    that group mapped and nothing else does (a SIGKILL skips the finalizers that unlink them)."""
    segments = mapped_segments(group_members(pid))
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return  # nothing left of it
    if segments:
        removed = remove_once_unmapped(segments, pid)
        log.info("removed %d shared-memory segments left by process group %d", removed, pid)
