"""`stream_options.continuous_usage_stats` (vLLM's extension): with include_usage, every chunk
carries the usage so far, and the last usage chunk the totals."""
from __future__ import annotations

import json

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, Served


def _chunks(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json=body, timeout=60) as response:
        assert response.status_code == 200
        return [json.loads(line[6:]) for line in response.iter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"]


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt": "hello there"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}]}),
])
def test_every_chunk_carries_the_usage_so_far(server: Served, path: str, extra: dict) -> None:
    body = {"model": MODEL_NAME, "max_tokens": 6, "ignore_eos": True, "stream": True, **extra,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = _chunks(server.url, path, body)
    *streamed, final = chunks
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    counts = [c["usage"]["completion_tokens"] for c in streamed]
    assert all(c["usage"]["prompt_tokens"] == final["usage"]["prompt_tokens"] for c in streamed)
    assert counts == sorted(counts) and counts[-1] == 6  # growing, ending at the total
    assert all(c["usage"]["total_tokens"] == c["usage"]["prompt_tokens"] + n for c, n in zip(streamed, counts))


def test_without_include_usage_the_extension_adds_nothing(server: Served) -> None:
    body = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    assert all("usage" not in c for c in _chunks(server.url, "/v1/completions", body))
