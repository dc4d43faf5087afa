"""One access-log line per generation request: id, route, status, tokens, TTFT, total; refusals too."""
from __future__ import annotations

import logging
import re

import httpx
import pytest

from tests.api.conftest import MODEL_NAME, Served
from tests.serving.probes import wait
from tokenmill.api.app import create_app

LINE = re.compile(r"^(\S+) (\S+) (\S+) (\S+) prompt=(\S+) output=(\S+) cached=(\S+) ttft_ms=(\S+) total_ms=([\d.]+)$")


def _lines(caplog: pytest.LogCaptureFixture) -> list[tuple[str, ...]]:
    found = [LINE.match(r.getMessage()) for r in caplog.records if r.name == "tokenmill.access"]
    assert all(found), [r.getMessage() for r in caplog.records if r.name == "tokenmill.access"]
    return [m.groups() for m in found if m]


def test_a_line_per_request_with_its_tokens_and_refusals_too(server: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.access")
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    assert httpx.post(server.url + "/v1/completions", json=body).status_code == 200
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200 and list(response.iter_lines())
    assert httpx.post(server.url + "/v1/completions", json={**body, "max_tokens": 0}).status_code == 400
    # the server's thread writes a line once the response has gone out, so the client may read it first
    wait(lambda: len(_lines(caplog)) >= 3, "the three access-log lines", 10)
    lines = _lines(caplog)
    assert len(lines) == 3
    (whole, streamed, refused) = lines
    for line in (whole, streamed):
        rid, method, path, status, prompt, output, cached, ttft, total = line
        assert rid.startswith("cmpl-") and (method, path, status) == ("POST", "/v1/completions", "200")
        assert (prompt, output) == ("3", "4") and float(ttft) <= float(total)
    assert refused[:5] == ("-", "POST", "/v1/completions", "400", "-")


def test_no_access_log_writes_nothing(server: Served, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenmill.access")
    url = server.live.serve(create_app(server.live.backend, MODEL_NAME, manage_backend=False, access_log=False))
    body = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 200
    assert _lines(caplog) == []
