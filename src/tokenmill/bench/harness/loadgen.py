"""The asyncio streaming client of `tokenmill bench serve`.

Each request is one `POST {url}/v1/completions` with a token-id prompt, `max_tokens` =
the wanted output, `ignore_eos` (so the output length is exact), `stream` and
`stream_options.include_usage`. The server-sent events are parsed as they arrive: a
chunk whose choice carries text is a token event (TTFT is the first, ITL the gaps
between them); the usage chunk gives the exact prompt, completion and cached token counts.

Two ways to send: `run_closed_loop` keeps N streams in flight; `run_open_loop` sends each
request at its `arrival_s` (Poisson or trace) however many are in flight. Both are bounded:
a deadline per request and one for the whole run, after which in-flight streams are
cancelled and unsent requests stay unsent.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from tokenmill.workloads.prompt_synth import RequestSpec

log = logging.getLogger(__name__)

# Outcomes of one request (RequestRecord.status).
OK, NOT_SENT, CANCELLED, TIMEOUT = "ok", "not_sent", "cancelled", "timeout"
HTTP_429, HTTP_4XX, HTTP_5XX = "http_429", "http_4xx", "http_5xx"
CONNECTION_ERROR, STREAM_ERROR = "connection_error", "stream_error"


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request; times in seconds, `start_s` from the run's start."""
    index: int
    prompt_len: int
    output_len: int
    status: str = NOT_SENT
    start_s: float | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # each token event, from send
    http_status: int | None = None
    error: str | None = None
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None

    @property
    def itl_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]


@dataclass(slots=True, frozen=True)
class Target:
    """Where and what to send (with `api_key`, as `Authorization: Bearer`)."""
    base_url: str
    model: str
    timeout_s: float
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def completion_body(self, spec: RequestSpec) -> dict[str, Any]:
        return {"model": self.model, "prompt": spec.prompt, "max_tokens": spec.output_len,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}


def make_client(max_connections: int | None) -> httpx.AsyncClient:
    # trust_env=False: no proxy from the environment, only the URL given is ever contacted
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=10.0), trust_env=False)


def _http_status_kind(code: int) -> str:
    return HTTP_429 if code == 429 else HTTP_5XX if code >= 500 else HTTP_4XX


def _on_event(record: RequestRecord, event: dict[str, Any], since_send: float) -> None:
    if "error" in event:
        record.status, record.error = STREAM_ERROR, str(event["error"].get("message", event["error"]))
        return
    usage = event.get("usage")
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens")
        record.completion_tokens = usage.get("completion_tokens")
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    for choice in event.get("choices") or ():
        if choice.get("text"):
            record.token_times_s.append(since_send)
        if choice.get("finish_reason"):
            record.finish_reason = choice["finish_reason"]


async def _stream(client: httpx.AsyncClient, target: Target, spec: RequestSpec, record: RequestRecord) -> None:
    sent = time.perf_counter()
    async with client.stream("POST", f"{target.base_url}/v1/completions", json=target.completion_body(spec),
                             headers=target.headers()) as resp:
        record.http_status = resp.status_code
        if resp.status_code != 200:
            record.status = _http_status_kind(resp.status_code)
            record.error = (await resp.aread()).decode("utf-8", "replace")[:300]
            return
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            _on_event(record, json.loads(payload), time.perf_counter() - sent)
            if record.status == STREAM_ERROR:
                return
    record.e2e_s = time.perf_counter() - sent
    record.ttft_s = record.token_times_s[0] if record.token_times_s else None
    record.status = OK if record.completion_tokens is not None else STREAM_ERROR
    if record.completion_tokens is None:
        record.error = "the stream ended without a usage chunk"


async def send_one(client: httpx.AsyncClient, target: Target, spec: RequestSpec, record: RequestRecord,
                   run_start: float) -> None:
    """Send one request and fill `record`; never raises except on cancellation."""
    record.start_s = time.perf_counter() - run_start
    record.status = CANCELLED  # until it ends some other way
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(client, target, spec, record)
    except TimeoutError:
        record.status, record.error = TIMEOUT, f"no complete answer within --timeout-s {target.timeout_s}"
    except httpx.HTTPError as exc:
        record.status, record.error = CONNECTION_ERROR, f"{type(exc).__name__}: {exc}"
    except (json.JSONDecodeError, AttributeError) as exc:
        record.status, record.error = STREAM_ERROR, f"malformed event: {exc}"


Progress = Callable[[RequestRecord], None]


def new_records(specs: Sequence[RequestSpec]) -> list[RequestRecord]:
    return [RequestRecord(i, len(s.prompt), s.output_len) for i, s in enumerate(specs)]


async def run_closed_loop(client: httpx.AsyncClient, target: Target, specs: Sequence[RequestSpec],
                          records: list[RequestRecord], concurrency: int, on_done: Progress) -> None:
    """Keep `concurrency` streams in flight until every request has been sent once."""
    run_start = time.perf_counter()
    pending = iter(range(len(specs)))

    async def slot() -> None:
        for i in pending:  # a shared iterator: each index goes to exactly one slot
            await send_one(client, target, specs[i], records[i], run_start)
            on_done(records[i])

    await asyncio.gather(*(slot() for _ in range(min(concurrency, len(specs)))))


async def run_open_loop(client: httpx.AsyncClient, target: Target, specs: Sequence[RequestSpec],
                        records: list[RequestRecord], on_done: Progress) -> None:
    """Send each request at its `arrival_s`, whatever else is in flight."""
    run_start = time.perf_counter()

    async def at_arrival(i: int) -> None:
        await asyncio.sleep(max(0.0, (specs[i].arrival_s or 0.0) - (time.perf_counter() - run_start)))
        await send_one(client, target, specs[i], records[i], run_start)
        on_done(records[i])

    await asyncio.gather(*(at_arrival(i) for i in range(len(specs))))


async def fetch_model_card(client: httpx.AsyncClient, base_url: str, model: str) -> dict[str, Any]:
    """The `/v1/models` entry for `model`; ValueError naming --model/--url when it is not served."""
    try:
        resp = await client.get(f"{base_url}/v1/models", timeout=10.0)
        resp.raise_for_status()
        cards = resp.json().get("data") or []
    except (httpx.HTTPError, ValueError) as exc:
        raise ValueError(f"--url {base_url}: GET /v1/models failed ({exc})") from exc
    for card in cards:
        if card.get("id") == model:
            return card
    served = ", ".join(str(c.get("id")) for c in cards) or "none"
    raise ValueError(f"--model {model!r} is not served at {base_url} (served: {served})")
