"""`tokenmill serve --prefill P --decode D`: real worker processes moving real KV.

Outputs must not depend on where a prompt was prefilled, faults in the transfer must end in a
correct (recomputed) answer, and every pool must return to idle with nothing held.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.disagg.conftest import (
    MAX_TOKENS,
    assert_idle,
    complete_all,
    metrics,
    mixed_prompts,
    reference,
    signal_worker,
    wait_for,
)
from tokenmill.bench.harness.serve_process import ServeProcess

REMOTE = 'tokenmill_disagg_decisions_total{decision="remote",reason="long_uncached_prompt"}'
SHORT = 'tokenmill_disagg_decisions_total{decision="local",reason="short_uncached_prompt"}'
FAILED = 'tokenmill_disagg_decisions_total{decision="local",reason="prefill_failed"}'
BUSY = 'tokenmill_disagg_decisions_total{decision="remote",reason="decode_worker_busy"}'


def worker_metric(server: ServeProcess, name: str, worker: str) -> float:
    return metrics(server).get(f'tokenmill_worker_{name}{{worker="{worker}"}}', 0.0)


SPECULATIVE = ("--speculative", "ngram", "--num-speculative-tokens", "3")


def speculation_counted(server: ServeProcess) -> None:
    """The decode worker's drafts reach /metrics; the prefill worker (one token each) drafts none."""
    wait_for(lambda: worker_metric(server, "spec_accepted_tokens", "decode-0") > 0, 10, "accepted drafts in /metrics")
    assert worker_metric(server, "spec_accepted_tokens", "decode-0") <= worker_metric(server, "spec_draft_tokens",
                                                                                       "decode-0")
    assert worker_metric(server, "spec_draft_tokens", "prefill-0") == 0


def streamed_with_logprobs_match(server: ServeProcess, prompt: list[int], expected: str) -> None:
    """Several tokens in one step reach a streaming client as the same text, one logprob each."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "logprobs": 1}
    text, logprobs = "", []
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60, trust_env=False) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line.removeprefix("data: "))["choices"][0]
                text += choice["text"]
                logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
    assert text == expected
    assert len(logprobs) == MAX_TOKENS and all(value <= 0.0 for value in logprobs)


def structured_output_holds(server: ServeProcess) -> None:
    schema = {"type": "object", "required": ["n"], "additionalProperties": False,
              "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999}}}
    body = {"model": "tiny", "prompt": "x " * 80, "max_tokens": 24, "temperature": 1.0, "seed": 5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}
    choice = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    assert choice["finish_reason"] == "stop" and 0 <= json.loads(choice["text"])["n"] <= 999, choice


def test_outputs_identical_across_aggregated_disaggregated_and_conditional(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    prompts = mixed_prompts(100, seed=1)
    expected = reference(tiny_dense, prompts)
    results = {}
    # the disaggregated decode worker also drafts: its text must not change
    for name, flags in (("agg", ("--workers", "1")), ("disagg", ("--disagg-threshold", "0", *SPECULATIVE)),
                        ("conditional", ("--disagg-threshold", "100"))):
        server = server_factory(*flags)
        results[name] = complete_all(server, prompts)
        assert_idle(server)
        seen = metrics(server)
        if name == "agg":
            assert not any(k.startswith("tokenmill_disagg_") for k in seen)
        elif name == "disagg":
            assert seen[REMOTE] == len(prompts)
            wait_for(lambda s=server: worker_metric(s, "kv_pulls", "decode-0") == len(prompts), 10, "pull counts")
            assert worker_metric(server, "kv_pull_failures", "decode-0") == 0
            assert worker_metric(server, "kv_transfer_bytes", "decode-0") > 0
            speculation_counted(server)
            streamed_with_logprobs_match(server, prompts[0], expected[0])
        else:
            decisions = sum(v for k, v in seen.items() if k.startswith("tokenmill_disagg_decisions_total"))
            assert seen[REMOTE] > 10 and seen[SHORT] > 10 and decisions == len(prompts)
        structured_output_holds(server)  # disagg: the decode worker's matcher replays the first token
        assert_idle(server)
    assert results["agg"] == expected
    assert results["disagg"] == expected
    assert results["conditional"] == expected


def test_a_full_prefill_queue_waits_remotely_when_decode_workers_may_not_prefill(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    """--local-prefill-limit 0: with the one prefill worker's queue full (limit 1, 8 clients at
    once), prompts queue there rather than on the decode worker, and every answer is right."""
    prompts = mixed_prompts(24, seed=7)
    server = server_factory("--disagg-threshold", "0", "--prefill-queue-limit", "1", "--local-prefill-limit", "0")
    assert complete_all(server, prompts) == reference(tiny_dense, prompts)
    seen = metrics(server)
    decisions = {k: v for k, v in seen.items() if k.startswith("tokenmill_disagg_decisions_total")}
    assert not any('decision="local"' in k for k in decisions), decisions
    assert seen[REMOTE] + seen.get(BUSY, 0.0) == len(prompts)
    wait_for(lambda: worker_metric(server, "kv_pulls", "decode-0") == len(prompts), 10, "every pull to be counted")
    assert_idle(server)


@pytest.mark.parametrize("flags,reason", [
    (("--transfer-faults", "corrupt=2"), "checksum"),  # every other pull: intact and recomputed ones mixed
    (("--kv-transfer-backends", "tcp", "--transfer-faults", "drop"), "transfer"),
])
def test_faulty_transfers_are_recomputed(tiny_dense: Path, server_factory: Callable[..., ServeProcess],
                                         flags: tuple[str, ...], reason: str) -> None:
    prompts = mixed_prompts(16, seed=2)
    server = server_factory("--disagg-threshold", "0", *flags)
    assert complete_all(server, prompts) == reference(tiny_dense, prompts)
    wait_for(lambda: worker_metric(server, "kv_pulls", "decode-0") == len(prompts), 10, "every pull to be counted")
    failures = worker_metric(server, "kv_pull_failures", "decode-0")
    if reason == "checksum":
        assert failures == len(prompts) // 2
    else:  # a drop that lands after the last byte is already buffered cannot fail that pull
        assert failures >= len(prompts) // 2
    assert_idle(server)


def stream_first_token_then(server: ServeProcess, prompt: list[int], on_first: Callable[[], None]) -> str:
    """Stream a completion; call `on_first` the moment the first token arrives; the whole text."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text, first = [], True
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120, trust_env=False) as reply:
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            text.append(json.loads(line[6:])["choices"][0]["text"])
            if first:
                first = False
                on_first()
    return "".join(text)


def test_prefill_worker_killed_mid_transfer(tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    # the decode worker waits a second before pulling: the prefill worker dies in that window
    server = server_factory("--disagg-threshold", "0", "--kv-transfer-backends", "tcp", "--transfer-faults", "delay=1")
    prompt = mixed_prompts(1, seed=3)[0]
    killed: list[int] = []
    text = stream_first_token_then(server, prompt,
                                   lambda: killed.append(signal_worker(server, "prefill-0", signal.SIGKILL)))
    assert text == reference(tiny_dense, [prompt])[0]
    wait_for(lambda: worker_metric(server, "kv_pull_failures", "decode-0") == 1, 10, "the failed pull")
    # the supervisor noticed (and restarts it): the dead worker's KV pool file is gone
    wait_for(lambda: not list(Path("/dev/shm").glob(f"tokenmill-{killed[0]}-*")), 10, "its shm files removed")
    prompts = mixed_prompts(6, seed=4)  # served while it restarts: prefilled wherever possible
    assert complete_all(server, prompts) == reference(tiny_dense, prompts)
    assert_idle(server, required=["decode-0"])


def test_unresponsive_prefill_worker_falls_back_to_local_prefill(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    server = server_factory("--disagg-threshold", "0")
    prompts = mixed_prompts(3, seed=5)
    pid = signal_worker(server, "prefill-0", signal.SIGSTOP)  # alive but silent: heartbeats stop
    try:
        assert complete_all(server, prompts) == reference(tiny_dense, prompts)
        assert metrics(server)[FAILED] >= 1
    finally:
        signal_worker_pid(pid, signal.SIGKILL)
    assert_idle(server, required=["decode-0"])


def signal_worker_pid(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def test_disconnect_before_first_token_cancels_prefill(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    server = server_factory("--disagg-threshold", "0")
    pid = signal_worker(server, "prefill-0", signal.SIGSTOP)  # the prompt waits in its socket
    resumed = threading.Timer(0.8, lambda: signal_worker_pid(pid, signal.SIGCONT))
    resumed.start()

    async def leave_early() -> None:
        body = {"model": "tiny", "prompt": mixed_prompts(1, seed=6)[0], "max_tokens": 200, "stream": True}
        async with httpx.AsyncClient(trust_env=False) as client:
            with pytest.raises(httpx.TimeoutException):
                await client.post(server.url + "/v1/completions", json=body, timeout=0.3)

    asyncio.run(leave_early())
    resumed.join()
    assert_idle(server)  # the prefill worker ran nothing to completion and holds nothing
    assert worker_metric(server, "kv_handles", "prefill-0") == 0
    assert worker_metric(server, "kv_pulls", "decode-0") == 0


def test_graceful_stop_finishes_in_flight_transfers(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    server = server_factory("--disagg-threshold", "0", "--transfer-faults", "delay=1")
    prompt = mixed_prompts(1, seed=7)[0]
    stopped: list[int] = []
    started = time.monotonic()
    text = stream_first_token_then(server, prompt,
                                   lambda: stopped.append(signal_worker(server, "prefill-0", signal.SIGTERM)))
    assert text == reference(tiny_dense, [prompt])[0]
    assert time.monotonic() - started >= 1.0  # the pull really waited out the delay
    # the stopping worker kept its KV until the decode worker had pulled it
    wait_for(lambda: worker_metric(server, "kv_pulls", "decode-0") == 1, 10, "the pull")
    assert worker_metric(server, "kv_pull_failures", "decode-0") == 0
    assert_idle(server, required=["decode-0"])
