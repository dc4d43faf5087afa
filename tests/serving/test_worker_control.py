"""`/admin/workers` beyond one aggregated pool, on a real `tokenmill serve` with mock workers:
re-roling a disaggregated worker, the admin API answered by every API server, and (without
processes) a start that never registers."""
from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.serving.conftest import start_server, stop_server
from tests.serving.probes import child_pids
from tests.serving.test_runtime_scaling import ADMIN_KEY, admin, completions, wait_for
from tokenmill.fleet.control_socket import CONTROL_SOCKET_ENV
from tokenmill.fleet.worker_control import WorkerControl
from tokenmill.runtime.supervisor import ChildSpec


def test_a_reroled_worker_serves_in_its_new_role(tiny_dense: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path, "--runner", "mock", "--mock-step-time", "0.01,0,0,0",
                          "--prefill", "1", "--decode", "1", "--disagg-threshold", "0", workers=2)
    try:
        assert admin(server, {"action": "start", "role": "agg"}).json()["error"]["param"] == "role"
        last = admin(server, {"action": "rerole", "worker": "decode-0", "to": "prefill"})
        assert last.status_code == 409 and last.json()["error"]["code"] == "last_serving_worker"
        response = admin(server, {"action": "rerole", "worker": "prefill-0", "to": "decode"})
        assert response.status_code == 202, response.text
        answer = response.json()
        assert [(w["name"], w["state"]) for w in answer["drained"]] == [("prefill-0", "draining")]
        assert [(w["name"], w["role"], w["state"]) for w in answer["started"]] == [("decode-1", "decode", "starting")]
        wait_for(server, lambda w: w["decode-1"]["state"] == "serving" and w["prefill-0"]["state"] == "gone", 30)
        assert admin(server).json()["replicas"] == {"prefill": {"starting": 0, "serving": 0, "draining": 0},
                                                    "decode": {"starting": 0, "serving": 2, "draining": 0}}
        assert asyncio.run(completions(server, 8, 12)) == [("length", 12)] * 8
        wait_for(server, lambda w: w["decode-1"]["requests_served"] > 0, 5)
    finally:
        stop_server(server)


def test_every_api_server_answers_for_the_workers_behind_the_admin_key(tiny_dense: Path, tmp_path: Path) -> None:
    server = start_server(tiny_dense, tmp_path, "--runner", "mock", "--mock-step-time", "0,0,0,0",
                          "--api-servers", "2", "--admin-api-key", ADMIN_KEY, workers=1)
    try:
        for _ in range(12):  # fresh connections: the kernel spreads them over both servers
            listed = admin(server, key=ADMIN_KEY)
            assert [w["name"] for w in listed.json()["data"]] == ["worker-0"], listed.text
            refused = admin(server, {"action": "start", "role": "decode"}, key=ADMIN_KEY)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "role"
            assert admin(server, {"action": "start", "role": "agg"}).status_code == 401
            assert admin(server).status_code == 401
        [control_socket] = {_environ(pid).get(CONTROL_SOCKET_ENV) for pid, cmdline in child_pids(server.process.pid).items()
                            if b"frontend" in cmdline}
        assert control_socket is not None and Path(control_socket).is_socket()
    finally:
        stop_server(server)


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


class _FakeSupervisor:
    """What WorkerControl asks of the supervisor, with no processes behind it."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {"worker-0": 100}
        self.signals: list[tuple[str, int]] = []
        self.may_restart: Callable[[str], bool] = lambda name: True
        self.on_settled: Callable[[str, int, bool], None] | None = None

    def pid(self, name: str) -> int:
        return self.pids[name]

    def add(self, spec: Any) -> int:
        self.pids[spec.name] = 100 + len(self.pids)
        return self.pids[spec.name]

    def send_signal(self, name: str, sig: int) -> bool:
        self.signals.append((name, sig))
        return True

    def tail(self, name: str) -> list[str]:
        return ["loading weights", "", "stuck on a lock"]


def test_a_start_that_never_registers_times_out_as_failed() -> None:
    supervisor = _FakeSupervisor()
    pool = SimpleNamespace(connections={}, mark_draining=lambda name: True)
    control = WorkerControl(supervisor, pool, lambda name, role: ChildSpec(name, ["true"]), ("agg",),
                            [("worker-0", "agg")], start_timeout_s=0.05)
    [rec] = control.start("agg", 1)
    control.observe()
    assert rec.state == "starting"
    time.sleep(0.1)
    control.observe()  # past its deadline, never registered; the launch worker has no deadline
    assert (rec.state, control.records["worker-0"].state) == ("failed", "starting")
    assert rec.reason == "did not register within 0.05 s: loading weights | stuck on a lock"
    assert supervisor.signals == [(rec.name, signal.SIGKILL)]
    assert not supervisor.may_restart(rec.name) and supervisor.may_restart("worker-0")
    supervisor.on_settled(rec.name, -9, False)  # its exit keeps the reason it failed for
    assert rec.state == "failed" and rec.reason.startswith("did not register")
    assert control.snapshot()["replicas"] == {"agg": {"starting": 1, "serving": 0, "draining": 0}}
