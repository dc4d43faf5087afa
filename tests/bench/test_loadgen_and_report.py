"""The streaming client, statistics and report of `tokenmill bench serve`, against an in-memory server."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tokenmill.bench.harness import loadgen
from tokenmill.bench.harness.loadgen import RequestRecord
from tokenmill.bench.harness.serve_report import TOP_LEVEL_KEYS, report_json
from tokenmill.bench.harness.serve_stats import SLO, distribution_ms, summarize, tpot_s
from tokenmill.cli import main
from tokenmill.workloads.prompt_synth import RequestSpec

TARGET = loadgen.Target("http://127.0.0.1:9", "tiny", timeout_s=5.0)


def _sse(prompt_len: int, output_len: int, cached: int = 0) -> bytes:
    events = [{"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]} for i in range(output_len - 1)]
    events.append({"choices": [{"index": 0, "text": "end", "finish_reason": "length"}]})
    events.append({"choices": [], "usage": {"prompt_tokens": prompt_len, "completion_tokens": output_len,
                                            "total_tokens": prompt_len + output_len,
                                            "prompt_tokens_details": {"cached_tokens": cached}}})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _fake_server(request: httpx.Request) -> httpx.Response:
    body = json.loads(request.content)
    assert body["stream"] and body["ignore_eos"] and body["stream_options"] == {"include_usage": True}
    marker = body["prompt"][0]
    if marker == 429:
        return httpx.Response(429, json={"error": {"message": "busy"}})
    if marker == 500:
        return httpx.Response(500, json={"error": {"message": "boom"}})
    if marker == 400:
        return httpx.Response(400, json={"error": {"message": "bad"}})
    if marker == 7:
        return httpx.Response(200, content=b'data: {"error": {"message": "worker died"}}\n\n')
    if marker == 8:
        return httpx.Response(200, content=b'data: {"choices": [{"text": "a"}]}\n\ndata: [DONE]\n\n')
    return httpx.Response(200, content=_sse(len(body["prompt"]), body["max_tokens"], cached=len(body["prompt"]) // 2))


def _drive(specs: list[RequestSpec], concurrency: int | None) -> list[RequestRecord]:
    async def go() -> list[RequestRecord]:
        records = loadgen.new_records(specs)
        done: list[int] = []
        async with httpx.AsyncClient(transport=httpx.MockTransport(_fake_server)) as client:
            if concurrency is None:
                await loadgen.run_open_loop(client, TARGET, specs, records, lambda r: done.append(r.index))
            else:
                await loadgen.run_closed_loop(client, TARGET, specs, records, concurrency,
                                              lambda r: done.append(r.index))
        assert sorted(done) == list(range(len(specs)))  # the progress callback saw each request once
        return records
    return asyncio.run(go())


@pytest.mark.parametrize("concurrency", [None, 1, 3])
def test_every_outcome_is_classified(concurrency: int | None) -> None:
    prompts = [[3, 4, 5, 6], [429, 4], [500, 4], [400, 4], [7, 4], [8, 4], [9] * 10]
    specs = [RequestSpec(p, 5, arrival_s=0.001 * i) for i, p in enumerate(prompts)]
    records = _drive(specs, concurrency)
    assert [r.status for r in records] == ["ok", "http_429", "http_5xx", "http_4xx", "stream_error",
                                           "stream_error", "ok"]
    ok = records[0]
    assert (ok.prompt_tokens, ok.completion_tokens, ok.cached_tokens, ok.finish_reason) == (4, 5, 2, "length")
    assert len(ok.token_times_s) == 5 and len(ok.itl_s) == 4 and ok.ttft_s == ok.token_times_s[0]
    assert records[1].http_status == 429 and "busy" in records[1].error
    assert "worker died" in records[4].error and "usage" in records[5].error


def test_summary_counts_tokens_cache_cost_and_goodput() -> None:
    records = _drive([RequestSpec([3] * 10, 4), RequestSpec([4] * 6, 2), RequestSpec([429], 3)], 2)
    summary = summarize(records, SLO(), usd_per_hour=3.6, duration_s=2.0)
    assert (summary.requests_ok, summary.requests_total) == (2, 3)
    assert summary.outcomes == {"ok": 2, "http_429": 1}
    assert (summary.prompt_tokens, summary.output_tokens, summary.cached_tokens) == (16, 6, 8)
    assert summary.cached_fraction == pytest.approx(0.5)
    assert summary.output_token_throughput == pytest.approx(3.0) and summary.request_throughput == 1.0
    assert summary.usd_per_million_output_tokens == pytest.approx(3.6 * 2 / 3600 / 6 * 1e6)
    assert summary.goodput == 1.0 and summary.length_mismatches == 0
    assert summary.itl_ms.count == 3 + 1 and summary.overhead_per_token_ms is None


def _record(ttft: float, e2e: float, tokens: int) -> RequestRecord:
    times = [ttft + i * (e2e - ttft) / max(tokens - 1, 1) for i in range(tokens)]
    return RequestRecord(0, 4, tokens, status="ok", start_s=0.0, ttft_s=ttft, e2e_s=e2e, token_times_s=times,
                         prompt_tokens=4, completion_tokens=tokens, cached_tokens=0)


def test_slo_uses_ttft_and_the_requests_mean_itl() -> None:
    fast, slow_start, slow_tokens = _record(0.05, 0.15, 11), _record(0.5, 0.6, 11), _record(0.05, 1.05, 11)
    assert tpot_s(fast) == pytest.approx(0.01) and tpot_s(_record(0.05, 0.05, 1)) is None
    slo = SLO(ttft_ms=100, itl_ms=20)
    assert [slo.met(r) for r in (fast, slow_start, slow_tokens)] == [True, False, False]
    summary = summarize([fast, slow_start, slow_tokens], slo, None, baseline_step_ms=5.0, duration_s=1.0)
    assert summary.goodput == 1.0 and summary.slo_met == 1 and summary.usd_per_million_output_tokens is None
    assert summary.overhead_per_token_ms.p50 == pytest.approx(summary.tpot_ms.p50 - 5.0)
    with pytest.raises(ValueError, match="--slo-itl-ms"):
        SLO(itl_ms=0)


def test_percentiles_are_ordered() -> None:
    dist = distribution_ms([0.001 * i for i in range(1, 101)])
    assert dist.p50 <= dist.p90 <= dist.p99 <= dist.max and dist.count == 100
    assert dist.p50 == pytest.approx(50.5) and distribution_ms([]) is None


def test_report_json_has_the_schema_and_optional_requests() -> None:
    specs = [RequestSpec([3] * 10, 4)]
    records = _drive(specs, 1)
    summary = summarize(records, SLO(), None)
    with_requests = report_json({"mode": "concurrency"}, specs, summary, None, records)
    assert all(key in with_requests for key in TOP_LEVEL_KEYS)
    assert with_requests["requests"][0]["itl_s"] == records[0].itl_s
    assert "requests" not in report_json({}, specs, summary, None, None)
    json.dumps(with_requests)  # serializable as-is


@pytest.mark.parametrize("flags, message", [
    (["--url", "ftp://x", "--model", "m", "--concurrency", "2"], "--url"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "0"], "--concurrency"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--request-rate", "-1"], "--request-rate"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--min-input", "9",
      "--max-input", "3"], "--max-input"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--compare-engine", "x.json"],
     "--compare-engine"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--trace", "/nonexistent.jsonl"], "--trace"),
    (["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "1", "--timeout-s", "2"], "--url"),
])
def test_bad_flags_and_unreachable_servers_exit_2(flags: list[str], message: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    assert main(["bench", "serve", *flags, "--quiet"]) == 2
    assert message in caplog.text


def test_engine_workload_is_bench_engines_own(tiny_dense, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    from tokenmill.bench.engine.engine_bench import EngineBenchConfig, make_workload
    from tokenmill.bench.serving.engine_compare import engine_workload_specs
    from tokenmill.textgen.tokenizer import Tokenizer

    lengths = {"num_requests": 5, "min_input": 8, "max_input": 30, "min_output": 2, "max_output": 9, "seed": 4}
    specs = engine_workload_specs(str(tiny_dense), lengths)
    expected = make_workload(EngineBenchConfig(model=str(tiny_dense), num_requests=5, min_prompt=8, max_prompt=30,
                                               min_output=2, max_output=9, seed=4),
                             2048, Tokenizer(tiny_dense).special_token_ids)  # as LLMEngine's tokenizer says
    assert [s.prompt for s in specs] == expected.prompts and [s.output_len for s in specs] == expected.output_lens
    other = tmp_path / "engine.json"
    other.write_text(json.dumps({"config": {"num_requests": 5, "min_prompt": 8, "max_prompt": 30, "min_output": 2,
                                            "max_output": 9, "seed": 1}, "tokenmill": {"output_tokens_per_s": 5.0}}))
    flags = ["--url", "http://127.0.0.1:9", "--model", "m", "--concurrency", "2", "--num-requests", "5",
             "--min-input", "8", "--max-input", "30", "--min-output", "2", "--max-output", "9", "--seed", "4",
             "--engine-workload", str(tiny_dense), "--compare-engine", str(other), "--quiet"]
    assert main(["bench", "serve", *flags]) == 2  # refused before sending anything
    assert "its seed is 1, but --seed is 4" in caplog.text
    assert main(["bench", "serve", *flags[:-3], "--mock-reference", "--quiet"]) == 2
    assert "--mock-reference needs" in caplog.text
