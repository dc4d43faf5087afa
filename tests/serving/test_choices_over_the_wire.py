"""n > 1 across worker processes: the later choices are routed to the worker holding the first
one's freshly computed prompt, and find it cached."""
from __future__ import annotations

import random
import re

import httpx

from tests.serving.conftest import Server


def _cached_total(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return float(re.search(r"^tokenmill_cached_tokens_total (\S+)$", text, re.MULTILINE).group(1))


def test_n_choices_share_one_prefill_across_workers(two_worker_server: Server) -> None:
    rng = random.Random(11)
    prompt = [rng.randint(3, 2000) for _ in range(80)]  # 5 full blocks, sent by no other test
    before = _cached_total(two_worker_server.url)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 3, "n": 3, "temperature": 0.0, "ignore_eos": True}
    response = httpx.post(two_worker_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [c["index"] for c in result["choices"]] == [0, 1, 2]
    assert len({c["text"] for c in result["choices"]}) == 1  # greedy: the same three times
    assert result["usage"]["completion_tokens"] == 9 and result["usage"]["prompt_tokens"] == 80
    assert _cached_total(two_worker_server.url) - before >= 2 * 64  # 2 later choices x (at least) 4 blocks
