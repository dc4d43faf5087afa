"""Four hosts (network namespaces on a bridge): a frontend on one, a prefill and a decode worker
on two others, etcd and NATS on the fourth. They meet through etcd, carry KV events over NATS
and KV over tcp; the greedy text, streamed or not, equals one host's. A SIGKILLed worker's lease ends it and the
fleet serves on. Stopped, nothing is left: no process, namespace, link or shared-memory file."""
from __future__ import annotations

import json
import signal
from pathlib import Path

import httpx

from tests.runtime.etcd_server import registered
from tests.serving.conftest import start_server, stop_server
from tests.serving.multi_host import fleet
from tests.serving.probes import answers, metric, wait
from tokenmill.bench.harness.serve_process import free_port
from tokenmill.runtime.netns import Hosts
from tokenmill.transfer.memory import remove_shared_files_of

FRONTEND, PREFILL, DECODE = 1, 2, 3
PROMPTS = [[(7 * i + 13 * j) % 900 + 5 for j in range(40 + 9 * i)] for i in range(3)]


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


def test_four_hosts_serve_disaggregated_as_one_and_leave_nothing(hosts: Hosts, tiny_dense: Path,
                                                                 tmp_path: Path) -> None:
    reference = start_server(tiny_dense, tmp_path / "one-host", workers=1)
    try:
        expected = _completions(reference.url)
    finally:
        stop_server(reference)

    with fleet(hosts, tiny_dense, tmp_path) as f:
        prefill = f.start_worker(PREFILL, "prefill", "p0")
        decode = f.start_worker(DECODE, "decode", "d0")
        base = f.start_frontend(FRONTEND, free_port(), "--disagg-threshold", "16")
        wait(lambda: answers(base) and metric(base, "tokenmill_workers") == 2, "both workers", timeout_s=180)

        assert _completions(base) == expected  # prefilled on one host, decoded on another
        assert _streamed(base, PROMPTS[1]) == expected[1]
        # the workers' counters reach the frontend with their next heartbeat
        wait(lambda: metric(base, "tokenmill_worker_kv_pulls") >= len(PROMPTS), "the decode worker's pulls")
        assert metric(base, "tokenmill_worker_kv_pull_failures") == 0
        assert metric(base, "tokenmill_worker_kv_transfer_bytes") > 0
        assert metric(base, "tokenmill_router_index_blocks") > 0  # events came over NATS

        prefill.send_signal(signal.SIGKILL)  # the prefill host dies
        prefill.wait(timeout=10)
        wait(lambda: sorted(registered(f.etcd.url)) == ["d0"], "the prefill worker's lease to end", timeout_s=30)
        wait(lambda: metric(base, "tokenmill_workers") == 1, "the frontend to drop it")
        assert _completions(base) == expected  # the decode worker prefills for itself now
        assert remove_shared_files_of(prefill.pid) >= 1  # what a supervisor does for a SIGKILLed worker

        frontend = f.processes[-1]
        for process in (frontend, decode):
            process.send_signal(signal.SIGTERM)
        assert decode.wait(timeout=60) == 0
        assert frontend.wait(timeout=60) in (0, 128 + signal.SIGTERM)  # uvicorn ends by the signal it caught
