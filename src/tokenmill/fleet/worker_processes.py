"""`tokenmill serve`'s supervisor of worker processes, with room to change the fleet at runtime.

`WorkerSupervisor` is the runtime `Supervisor` plus what the admin API needs: children added
while it runs (`add`), a say in whether an exited child comes back (`may_restart`, asked
before the supervisor's own restart budget), a word when an exit is settled (`on_settled`),
signals to one child, and the last lines each child wrote to stderr (`tail`), which are still
copied to this process's stderr as they come: the reason a start failed is in them. One child
may start first and alone, its output held until it says its engine took the options
(`start_gated`): a refusal is then its one line (held lines are not in its tail).
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO

from tokenmill.fleet.output_gate import OutputGate, write_line
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
        self._readers: dict[str, list[threading.Thread]] = {}

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

    async def start_gated(self, spec: ChildSpec, argv: list[str], gate: OutputGate,
                          timeout_s: float) -> list[str] | None:
        """Start `spec` alone, as `argv` this once (restarts take the spec's), its stdout and stderr
        held by `gate` until it opens: None then. If the child exits first, or `timeout_s` passes,
        it is stopped (and stays on record, for `pid`), its output dropped: the stderr lines it held,
        the reason it gave. Cancelled, it is stopped too."""
        process = self._spawn(ChildSpec(spec.name, argv, spec.env), gate)
        self.children[spec.name] = _Child(spec, process)
        deadline, timed_out = time.monotonic() + timeout_s, False
        try:
            while not gate.opened.is_set() and process.poll() is None:
                if timed_out := time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.05)
        finally:
            if not gate.opened.is_set():
                kill_leftovers(process.pid)
                process.wait()
                self._join_readers(spec.name)
        if gate.opened.is_set():  # an exit right after the line is a crash to restart, not a refusal
            log.info("%s took its engine's options", spec.name)
            return None
        said = gate.held_lines("stderr")
        if timed_out:
            said.append(f"(stopped: no word from it in {timeout_s:g} s)")
        return said or [f"exited with code {process.returncode}, saying nothing"]

    def _spawn(self, spec: ChildSpec, gate: OutputGate | None = None) -> subprocess.Popen:
        (log.debug if gate else log.info)("starting %s", spec.name)  # a refused start is told by its reason only
        process = subprocess.Popen(spec.argv, env={**os.environ, **spec.env}, start_new_session=True,
                                   stderr=subprocess.PIPE, stdout=subprocess.PIPE if gate else None)
        tail = self._tails[spec.name] = deque(maxlen=TAIL_LINES)  # this incarnation's lines only
        streams = [("stderr", process.stderr, tail)] + ([("stdout", process.stdout, None)] if gate else [])
        self._readers[spec.name] = readers = [
            threading.Thread(target=_copy_lines, args=(name, stream, tail, self._tails_lock, gate), daemon=True,
                             name=f"{name}-{spec.name}") for name, stream, tail in streams]
        for reader in readers:
            reader.start()
        return process

    def _join_readers(self, name: str) -> None:
        """Let the readers of an exited child take its last lines (`TAIL_JOIN_S` for them all)."""
        deadline = time.monotonic() + TAIL_JOIN_S
        for reader in self._readers.get(name, []):
            reader.join(max(0.0, deadline - time.monotonic()))

    def _handle_exit(self, child: _Child, code: int) -> None:
        name = child.spec.name
        kill_leftovers(child.process.pid)
        self._join_readers(name)
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


def _copy_lines(name: str, stream: IO[bytes], tail: deque[str] | None, lock: threading.Lock,
                gate: OutputGate | None) -> None:
    """Copy a child's stream to ours of that `name` line by line (unless `gate` holds it), keeping
    the last few in `tail`."""
    with stream:
        for line in iter(stream.readline, b""):
            if gate is not None and gate.hold(name, line):
                continue
            if tail is not None:
                with lock:
                    tail.append(line.decode("utf-8", errors="replace").rstrip())
            write_line(name, line)
