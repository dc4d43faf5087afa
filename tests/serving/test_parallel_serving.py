"""`tokenmill serve --tp 2 / --ep 2 / --ep 2 --attention-dp 2` end to end: the OpenAI client gets the single-process
engine's text, and SIGKILL of a worker's second rank restarts that worker whole while the
stream it served migrates without a seam."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import openai
import pytest

from tests.serving.conftest import start_server, stop_server
from tests.serving.probes import busy_worker_pid, in_flight_by_pid, stream_with_a_kill, wait
from tests.serving.test_serve import _reference

PROMPT = [11, 12, 13, 14, 15, 16, 17]


def _ranks_of(worker_pid: int) -> list[int]:
    """The worker's rank processes (its children running the follower module)."""
    children = Path(f"/proc/{worker_pid}/task/{worker_pid}/children").read_text().split()
    return [int(c) for c in children
            if b"tokenmill.engine.parallel.follower" in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("flags", [["--tp", "2"], ["--ep", "2"], ["--ep", "2", "--attention-dp", "2"]],
                         ids=["tp2", "ep2", "ep2-dp2"])
def test_a_parallel_worker_serves_the_single_process_text(tiny_moe: Path, tmp_path: Path, flags: list[str]) -> None:
    server = start_server(tiny_moe, tmp_path, *flags, "--kv-cache-blocks", "256")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        done = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=32, temperature=0,
                                         extra_body={"ignore_eos": True})
        assert done.choices[0].text == _reference(tiny_moe, PROMPT, 32)
        assert len(_ranks_of(int(server.registry()[0]["pid"]))) == 1
    finally:
        stop_server(server)


def test_killing_a_rank_restarts_its_worker_and_the_stream_migrates(tiny_moe: Path, tmp_path: Path) -> None:
    server = start_server(tiny_moe, tmp_path, "--tp", "2", "--kv-cache-blocks", "256", workers=2)
    try:
        undisturbed = _reference(tiny_moe, PROMPT, 600)

        def kill_a_rank_of_the_busy_worker() -> int:
            worker = busy_worker_pid(server, before)
            os.kill(_ranks_of(worker)[0], signal.SIGKILL)
            return worker

        before = in_flight_by_pid(server)
        text, worker = stream_with_a_kill(server.url, PROMPT, 600, kill_a_rank_of_the_busy_worker)
        assert text == undisturbed
        wait(lambda: len(server.registry()) == 2 and all(int(w["pid"]) != worker for w in server.registry()),
             "a restarted worker in the killed one's place", 90)
        assert not Path(f"/proc/{worker}").exists()  # the worker went, not just its rank
    finally:
        stop_server(server)
