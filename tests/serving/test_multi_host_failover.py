"""Failures across hosts (network namespaces on a bridge): two aggregated workers on two hosts, a
frontend on a third, etcd and NATS on a fourth.
- SIGKILL of the worker streaming a request: its etcd lease ends it, the frontend drops it, and
  the request migrates and finishes with the text it would have had undisturbed.
- etcd stopped: the fleet serves on with the last set it knew; etcd back (its data gone): the
  survivor registers again and a new worker is found through it.
Stopped, nothing is left: no process, namespace, link or shared-memory file."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import httpx

from tests.runtime.etcd_server import registered
from tests.serving.multi_host import fleet
from tests.serving.probes import answers, metric, wait
from tests.serving.test_serve import _reference
from tokenmill.bench.harness.serve_process import free_port
from tokenmill.runtime.netns import Hosts
from tokenmill.transfer.memory import remove_shared_files_of

FRONTEND, HOST_A, HOST_B = 1, 2, 3
PROMPT = [11, 12, 13, 14, 15, 16, 17]
LONG = 1500  # tokens: the stream is still running when its worker is killed


def _stream_killing_its_worker(base: str, workers: dict[str, subprocess.Popen[bytes]]) -> tuple[str, str]:
    """Stream PROMPT; after 40 chunks SIGKILL the worker running it. The text and who was killed."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": LONG, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    text, killed = [], ""
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300, trust_env=False) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
            if not killed and len(text) >= 40:
                killed = _busy(base, workers)
                workers[killed].send_signal(signal.SIGKILL)
    return "".join(text), killed


def _busy(base: str, workers: dict[str, subprocess.Popen[bytes]]) -> str:
    """The worker whose heartbeat says it is running a request."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for name in workers:
            if metric(base, "tokenmill_worker_num_running", worker=name) > 0:
                return name
        time.sleep(0.05)
    raise AssertionError("no worker reported the stream running")


def _complete(base: str) -> str:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0.0, "ignore_eos": True}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120, trust_env=False)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["text"]


def test_a_killed_host_migrates_its_stream_and_etcd_can_go_away(hosts: Hosts, tiny_dense: Path,
                                                                  tmp_path: Path) -> None:
    undisturbed, short = _reference(tiny_dense, PROMPT, LONG), _reference(tiny_dense, PROMPT, 8)
    with fleet(hosts, tiny_dense, tmp_path) as f:
        workers = {name: f.start_worker(host, "agg", name) for host, name in ((HOST_A, "a0"), (HOST_B, "b0"))}
        base = f.start_frontend(FRONTEND, free_port())
        wait(lambda: answers(base) and metric(base, "tokenmill_workers") == 2, "both workers", timeout_s=180)

        text, killed = _stream_killing_its_worker(base, workers)
        assert text == undisturbed  # no seam: the survivor took the stream over from its tokens so far
        assert metric(base, "tokenmill_request_migrations_total") >= 1
        survivor = "b0" if killed == "a0" else "a0"
        wait(lambda: sorted(registered(f.etcd.url)) == [survivor], "the killed worker's lease to end", timeout_s=30)
        wait(lambda: metric(base, "tokenmill_workers") == 1, "the frontend to drop it")
        remove_shared_files_of(workers[killed].pid)  # what a supervisor does for a SIGKILLed worker

        f.etcd.stop()  # membership is gone for a while: the frontend serves on the last set it knew
        assert _complete(base) == short
        assert metric(base, "tokenmill_workers") == 1
        f.etcd.restart(fresh=True)  # back, with its data lost: the survivor writes itself back
        wait(lambda: sorted(registered(f.etcd.url)) == [survivor], "the survivor to register again", timeout_s=60)
        f.start_worker(HOST_A if killed == "a0" else HOST_B, "agg", "c0")  # and a newcomer is found through it
        wait(lambda: metric(base, "tokenmill_workers") == 2, "the frontend to find the new worker", timeout_s=180)
        assert sorted(registered(f.etcd.url)) == sorted([survivor, "c0"])
        assert _complete(base) == short

        for process in f.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in f.processes:
            if process is not workers[killed]:
                assert process.wait(timeout=60) in (0, 128 + signal.SIGTERM)
