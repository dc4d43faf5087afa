"""Four hosts (network namespaces on a bridge): a frontend on one, a prefill and a decode worker
on two others, etcd and NATS on the fourth. They meet through etcd, carry KV events over NATS
and KV over tcp; the greedy text, streamed or not, equals one host's. A SIGKILLed worker's lease ends it and the
fleet serves on. Stopped, nothing is left: no process, namespace, link or shared-memory file."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.runtime.etcd_server import EtcdServer, registered
from tests.runtime.nats_server import NatsServer
from tests.serving.conftest import start_server, stop_server
from tests.serving.probes import answers, metric, wait
from tokenmill.bench.netns import Hosts
from tokenmill.bench.serve_process import free_port
from tokenmill.transfer.memory import SHM_DIR, SHM_PREFIX, remove_shared_files_of

FRONTEND, PREFILL, DECODE, INFRA = 1, 2, 3, 4
PROMPTS = [[(7 * i + 13 * j) % 900 + 5 for j in range(40 + 9 * i)] for i in range(3)]


@pytest.fixture
def hosts() -> Iterator[Hosts]:
    made = Hosts(4)
    yield made
    made.close()


def _completions(base: str) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
        reply = httpx.post(f"{base}/v1/completions", json=body, timeout=120, trust_env=False)
        assert reply.status_code == 200, reply.text
        texts.append(reply.json()["choices"][0]["text"])
    return texts


def _streamed(base: str, prompt: list[int]) -> str:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    text = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120, trust_env=False) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += [choice["text"] for choice in json.loads(line[6:])["choices"]]
    return "".join(text)


def worker_argv(hosts: Hosts, host: int, role: str, name: str, etcd: str, nats: str, model: Path) -> list[str]:
    address = hosts.address(host)
    return [*hosts.prefix(host), sys.executable, "-m", "tokenmill.cli", "worker", "--model", str(model),
            "--served-model-name", "tiny", "--role", role, "--worker-id", name, "--address", f"tcp://{address}:0",
            "--kv-transfer-backends", "tcp", "--kv-transfer-host", address, "--discovery", etcd,
            "--discovery-ttl-s", "1", "--event-plane", nats]


def test_four_hosts_serve_disaggregated_as_one_and_leave_nothing(hosts: Hosts, tiny_dense: Path,
                                                                 tmp_path: Path) -> None:
    reference = start_server(tiny_dense, tmp_path / "one-host", workers=1)
    try:
        expected = _completions(reference.url)
    finally:
        stop_server(reference)

    infra = hosts.address(INFRA)
    etcd = EtcdServer(tmp_path, infra, hosts.prefix(INFRA))
    nats = NatsServer(infra, hosts.prefix(INFRA))
    processes: list[subprocess.Popen[bytes]] = []
    try:
        etcd.start()
        nats.start()
        for host, role, name in ((PREFILL, "prefill", "p0"), (DECODE, "decode", "d0")):
            processes.append(subprocess.Popen(worker_argv(hosts, host, role, name, etcd.url, nats.url, tiny_dense),
                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        port = free_port()
        processes.append(subprocess.Popen(
            [*hosts.prefix(FRONTEND), sys.executable, "-m", "tokenmill.cli", "frontend", "--model", str(tiny_dense),
             "--served-model-name", "tiny", "--discovery", etcd.url, "--event-plane", nats.url,
             "--disagg-threshold", "16", "--host", hosts.address(FRONTEND), "--port", str(port)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        base = f"http://{hosts.address(FRONTEND)}:{port}"
        wait(lambda: answers(base) and metric(base, "tokenmill_workers") == 2, "both workers", timeout_s=180)

        assert _completions(base) == expected  # prefilled on one host, decoded on another
        assert _streamed(base, PROMPTS[1]) == expected[1]
        # the workers' counters reach the frontend with their next heartbeat
        wait(lambda: metric(base, "tokenmill_worker_kv_pulls") >= len(PROMPTS), "the decode worker's pulls")
        assert metric(base, "tokenmill_worker_kv_pull_failures") == 0
        assert metric(base, "tokenmill_worker_kv_transfer_bytes") > 0
        assert metric(base, "tokenmill_router_index_blocks") > 0  # events came over NATS

        processes[0].send_signal(signal.SIGKILL)  # the prefill host dies
        processes[0].wait(timeout=10)
        wait(lambda: sorted(registered(etcd.url)) == ["d0"], "the prefill worker's lease to end", timeout_s=30)
        wait(lambda: metric(base, "tokenmill_workers") == 1, "the frontend to drop it")
        assert _completions(base) == expected  # the decode worker prefills for itself now
        assert remove_shared_files_of(processes[0].pid) >= 1  # what a supervisor does for a SIGKILLed worker

        decode, frontend = processes[1:]
        for process in (frontend, decode):
            process.send_signal(signal.SIGTERM)
        assert decode.wait(timeout=60) == 0
        assert frontend.wait(timeout=60) in (0, 128 + signal.SIGTERM)  # uvicorn ends by the signal it caught
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait(timeout=10)
        nats.stop()
        etcd.stop()
    hosts.close()
    wait(lambda: hosts.leftovers() == [], "the namespaces and their links to go", timeout_s=30)  # freed lazily
    assert not [p for process in processes for p in SHM_DIR.glob(f"{SHM_PREFIX}{process.pid}-*")]
