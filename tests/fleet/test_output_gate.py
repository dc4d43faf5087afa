"""A worker started alone with its output held until it says its options are accepted
(`WorkerSupervisor.start_gated`), over real child processes: nothing it writes before that line
reaches serve's stdout or stderr; after it, all of it does, in order, and the line itself never;
a child that exits first, or says nothing in time, is stopped and its stderr is the reason."""
from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tokenmill.fleet.output_gate import OutputGate
from tokenmill.fleet.worker_processes import WorkerSupervisor
from tokenmill.runtime.supervisor import ChildSpec

ACCEPTED = "test-child: options accepted"


def child(script: str) -> list[str]:
    return [sys.executable, "-c", "import sys, time, pathlib\n" + script]


def joined(supervisor: WorkerSupervisor, name: str) -> None:
    """Once the child has exited: its streams read to the end."""
    supervisor.children[name].process.wait(10)
    for reader in supervisor._readers[name]:
        reader.join(10)


def test_lines_before_the_opening_line_are_held_then_written_in_order(tmp_path: Path,
                                                                       capfd: pytest.CaptureFixture[str]) -> None:
    go = tmp_path / "go"
    argv = child(f"print('log on stdout', flush=True); print('warning on stderr', file=sys.stderr, flush=True)\n"
                 f"while not pathlib.Path({str(go)!r}).exists(): time.sleep(0.02)\n"
                 f"print({ACCEPTED!r}, file=sys.stderr, flush=True); print('after', file=sys.stderr, flush=True)")
    supervisor = WorkerSupervisor([])

    async def scenario() -> list[str] | None:
        task = asyncio.create_task(supervisor.start_gated(ChildSpec("w", ["restarted-as-this"]), argv,
                                                          OutputGate(ACCEPTED), timeout_s=60))
        try:
            await asyncio.sleep(0.5)
            held = capfd.readouterr()
            assert (held.out, held.err) == ("", ""), "written before the child said its options were accepted"
            assert not task.done()
        finally:
            go.touch()  # the child ends either way
        return await task

    assert asyncio.run(scenario()) is None
    assert supervisor.children["w"].spec.argv == ["restarted-as-this"]  # a restart takes the spec, not the flag
    joined(supervisor, "w")
    out = capfd.readouterr()
    assert out.out == "log on stdout\n"
    assert out.err == "warning on stderr\nafter\n"
    assert supervisor.tail("w") == ["after"]


def test_a_child_that_exits_first_is_a_refusal_and_writes_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    argv = child("print('INFO importing', flush=True); print('a warning', file=sys.stderr)\n"
                 "print('error: --engine-arg x=1: no such option', file=sys.stderr); sys.exit(2)")
    supervisor = WorkerSupervisor([])
    lines = asyncio.run(supervisor.start_gated(ChildSpec("w", argv), argv, OutputGate(ACCEPTED), timeout_s=60))
    assert lines == ["a warning", "error: --engine-arg x=1: no such option"]
    assert supervisor.children["w"].process.returncode == 2
    assert capfd.readouterr() == ("", "")


def test_a_child_that_never_says_is_stopped_at_the_timeout(capfd: pytest.CaptureFixture[str]) -> None:
    argv = child("print('starting', file=sys.stderr, flush=True); time.sleep(600)")
    supervisor = WorkerSupervisor([])
    lines = asyncio.run(supervisor.start_gated(ChildSpec("w", argv), argv, OutputGate(ACCEPTED), timeout_s=1.0))
    assert lines == ["starting", "(stopped: no word from it in 1 s)"]
    assert supervisor.children["w"].process.poll() is not None
    assert capfd.readouterr() == ("", "")


def test_a_cancelled_start_stops_the_child() -> None:
    argv = child("time.sleep(600)")
    supervisor = WorkerSupervisor([])

    async def scenario() -> None:
        task = asyncio.create_task(supervisor.start_gated(ChildSpec("w", argv), argv, OutputGate(ACCEPTED), 60))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert supervisor.children["w"].process.poll() is not None


def test_an_exit_right_after_the_opening_line_is_no_refusal(capfd: pytest.CaptureFixture[str]) -> None:
    """The line came, so the options were taken: the exit is a crash for the supervisor to restart."""
    argv = child(f"print('log', file=sys.stderr); print({ACCEPTED!r}, file=sys.stderr); sys.exit(1)")
    supervisor = WorkerSupervisor([])
    assert asyncio.run(supervisor.start_gated(ChildSpec("w", argv), argv, OutputGate(ACCEPTED), 60)) is None
    joined(supervisor, "w")
    assert capfd.readouterr().err == "log\n"
