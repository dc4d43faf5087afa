"""`tokenmill serve --speculative ngram` across real processes: a disaggregated deployment whose
decode worker drafts and verifies returns the text one engine generates without speculation, and
the worker's acceptance counters reach /metrics."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.disagg.conftest import MAX_TOKENS, assert_idle, complete_all, metrics, reference, wait_for
from tokenmill.bench.harness.serve_process import ServeProcess


def repetitive_prompts(count: int, seed: int = 0, vocab: int = 2048) -> list[list[int]]:
    """Prompts that repeat their own opening: the tiny model's continuation often copies them."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        head = [rng.randrange(3, vocab) for _ in range(rng.randrange(20, 80))]
        out.append(head + head[:16] + head)
    return out


def test_disaggregated_speculative_decoding_gives_the_plain_text(
        tiny_dense: Path, server_factory: Callable[..., ServeProcess]) -> None:
    prompts = repetitive_prompts(24, seed=2)
    expected = reference(tiny_dense, prompts)
    server = server_factory("--disagg-threshold", "0", "--speculative", "ngram", "--num-speculative-tokens", "3")
    assert complete_all(server, prompts) == expected

    def counted() -> bool:
        seen = metrics(server)
        return seen.get('tokenmill_worker_spec_accepted_tokens{worker="decode-0"}', 0) > 0
    wait_for(counted, 10, "the decode worker's accepted drafts in /metrics")
    seen = metrics(server)
    drafted = seen['tokenmill_worker_spec_draft_tokens{worker="decode-0"}']
    assert seen['tokenmill_worker_spec_accepted_tokens{worker="decode-0"}'] <= drafted
    assert seen.get('tokenmill_worker_spec_draft_tokens{worker="prefill-0"}', 0) == 0  # prefill drafts nothing
    streamed_with_logprobs_match(server, prompts[0], expected[0])
    assert_idle(server)


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


@pytest.mark.parametrize(("flags", "message"), [
    (["--speculative", "medusa"], "--speculative must be one of ngram"),
    (["--speculative", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens must be in [1, 16]"),
    (["--num-speculative-tokens", "2"], "--num-speculative-tokens needs --speculative ngram"),
    (["--speculative", "ngram", "--runner", "mock"], "--speculative needs --runner torch"),
])
def test_bad_speculative_flags_exit_2_naming_the_flag(tiny_dense: Path, flags: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(tiny_dense), "--port", "0",
                           *flags], capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and message in lines[0], done.stderr
