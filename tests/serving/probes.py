"""What the multi-process serving tests ask a running frontend over HTTP, and how they wait."""
from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.bench.harness.serve_process import ServeProcess as Server

T = TypeVar("T")


def metric(base: str, name: str, **labels: str) -> float:
    """The sum of every sample called `name` (with these labels) on the frontend's /metrics; 0 if none."""
    text = httpx.get(f"{base}/metrics", timeout=5, trust_env=False).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and labels.items() <= sample.labels.items())


def answers(base: str) -> bool:
    try:
        return httpx.get(f"{base}/v1/models", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def wait(condition: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def in_flight_by_pid(server: Server) -> dict[int, int]:
    """Each worker's requests in flight, as its last heartbeat said."""
    return {int(w["pid"]): int(w["metadata"].get("in_flight", 0)) for w in server.registry()}


def busy_worker_pid(server: Server, before: dict[int, int], timeout_s: float = 5.0) -> int:
    """The pid of the one worker whose heartbeat reports more requests in flight than `before`
    (`in_flight_by_pid` taken before the request was sent): another worker's last heartbeat may
    still count a request that has just finished there."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busier = [pid for pid, n in in_flight_by_pid(server).items() if n > before.get(pid, 0)]
        if len(busier) == 1:
            return busier[0]
        time.sleep(0.05)
    raise AssertionError("no single worker reported the request in flight")


def kill_the_routed_worker(server: Server, inspect: Callable[[int], T] = lambda pid: None) -> tuple[int, T]:
    """SIGKILL the worker the router placed the one live stream on (the worker with load in the
    router's view; a heartbeat can be half a second late, and a small model generates all its
    tokens within that): every worker is stopped (SIGSTOP) while it is found, so that the stream
    cannot finish first, and the others are resumed after. `inspect` sees its pid before the kill:
    (pid, what inspect returned)."""
    pids = {w["worker_id"]: int(w["pid"]) for w in server.registry()}
    for each in pids.values():
        os.kill(each, signal.SIGSTOP)
    killed = None
    try:
        [busy] = [w for w in pids if metric(server.url, "tokenmill_router_worker_load_blocks", worker=w) > 0]
        seen = inspect(pids[busy])
        os.kill(pids[busy], signal.SIGKILL)
        killed = pids[busy]
    finally:
        for each in pids.values():
            if each != killed:
                os.kill(each, signal.SIGCONT)
    return killed, seen


def stream_with_a_kill(base: str, prompt: list[int], max_tokens: int, kill: Callable[[], T],
                       after_chunks: int = 40, **sampling: object) -> tuple[str, T]:
    """A completion (greedy, unless `sampling` says otherwise) streamed in full, calling `kill`
    after its `after_chunks`-th chunk: (text, what kill returned)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    text: list[str] = []
    killed: T | None = None
    for chunk in client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, stream=True,
                                           extra_body={"ignore_eos": True}, **{"temperature": 0, **sampling}):
        text.append(chunk.choices[0].text if chunk.choices else "")
        if killed is None and len(text) == after_chunks:
            killed = kill()
    assert killed is not None, f"the stream ended before its chunk {after_chunks}"
    return "".join(text), killed


def child_pids(pid: int) -> dict[int, list[bytes]]:
    """The processes whose parent is `pid`, with their command lines (read from /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(fields[1]) == pid:
            found[int(stat.parent.name)] = cmdline
    return found
