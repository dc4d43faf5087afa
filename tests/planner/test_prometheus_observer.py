"""The live observation: two scrapes of a frontend's real metrics (its own FrontendMetrics,
rendered by prometheus-client), read back with prometheus-client's parser, give the interval's
demand, ISL/OSL, cache hits and latency quantiles; a restarted frontend reads as missing."""
from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from tokenmill.api.metrics import FrontendMetrics
from tokenmill.planner.observation import SERVING, STARTING
from tokenmill.planner.prometheus_observer import observe, scrape

WORKERS = [{"name": "decode-0", "role": "decode", "state": "serving", "serving_since": 0.0},
           {"name": "decode-1", "role": "decode", "state": "starting"},
           {"name": "prefill-0", "role": "prefill", "state": "serving", "serving_since": 95.0}]


def _metrics() -> FrontendMetrics:
    snapshot = {'tokenmill_worker_kv_usage{worker="decode-0"}': 0.6, 'tokenmill_worker_num_waiting{worker="decode-0"}': 3.0,
                'tokenmill_worker_kv_usage{worker="prefill-0"}': 0.1}
    return FrontendMetrics(lambda: snapshot)


def _serve(m: FrontendMetrics, n: int, ttft: float, prompt: int, output: int, cached: int) -> None:
    for _ in range(n):
        timer = m.start_request()
        m.ttft.observe(ttft)
        m.itl.observe(0.02)
        timer.on_finish("success", prompt, output, cached)


def test_two_scrapes_make_one_interval() -> None:
    m = _metrics()
    _serve(m, 5, 0.3, 100, 10, 0)
    before = scrape(generate_latest(m.registry).decode())
    _serve(m, 20, 0.6, 1000, 50, 250)
    m.start_request()  # admitted, not finished: demand all the same
    after = scrape(generate_latest(m.registry).decode())
    obs = observe(before, after, at_s=100.0, interval_s=30.0, workers=WORKERS, warmup_s=60.0)
    assert obs.requests == 21
    assert obs.mean_isl == pytest.approx(1000) and obs.mean_osl == pytest.approx(50)
    assert obs.hit_fraction == pytest.approx(0.25)
    assert 0.5 <= obs.ttft_p50_s <= 0.75 and 0.5 <= obs.ttft_p90_s <= 0.75  # the 0.6 s bucket (0.5, 0.75]
    assert 0.01 <= obs.itl_p50_s <= 0.025
    assert obs.replicas == {"decode": {SERVING: 1, STARTING: 1}, "prefill": {SERVING: 1}}
    assert obs.warm_replicas == {"decode": 1}  # prefill-0 has served only 5 s
    assert obs.decode_kv_usage == pytest.approx(0.6) and obs.queue_depth == 3
    assert obs.missing == []


def test_a_restarted_frontend_is_missing_not_negative() -> None:
    old, new = _metrics(), _metrics()
    _serve(old, 10, 0.3, 100, 10, 0)
    _serve(new, 2, 0.3, 100, 10, 0)
    obs = observe(scrape(generate_latest(old.registry).decode()), scrape(generate_latest(new.registry).decode()),
                  at_s=30.0, interval_s=30.0, workers=WORKERS, warmup_s=60.0)
    assert obs.requests is None and "requests" in obs.missing


def test_an_idle_interval_is_zero_traffic() -> None:
    m = _metrics()
    _serve(m, 3, 0.3, 100, 10, 0)
    text = generate_latest(m.registry).decode()
    obs = observe(scrape(text), scrape(text), at_s=30.0, interval_s=30.0, workers=WORKERS, warmup_s=60.0)
    assert obs.requests == 0 and obs.mean_isl is None and obs.ttft_p50_s is None and obs.missing == []


def test_prompt_spread_and_the_busiest_second_come_from_the_frontend(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    now = [100.0]
    monkeypatch.setattr("tokenmill.api.metrics.time.monotonic", lambda: now[0])
    m = _metrics()
    m.start_request(50).on_finish("success", 50, 10, 0)
    now[0] = 101.0  # second 100 (50 tokens) is over at the next admission: before the interval
    m.start_request(0)
    before = scrape(generate_latest(m.registry).decode())
    prompts, per_second = [], {}
    for second, count, prompt in ((102, 3, 100), (103, 20, 300), (107, 2, 100), (108, 1, 100)):
        for k in range(count):
            now[0] = second + k / 100
            m.start_request(prompt).on_finish("success", prompt, 10, 0)
            prompts.append(prompt)
            per_second[second] = per_second.get(second, 0) + prompt
    obs = observe(before, scrape(generate_latest(m.registry).decode()), at_s=30.0, interval_s=30.0,
                  workers=WORKERS, warmup_s=60.0)
    assert obs.isl_cv2 == pytest.approx(np.var(prompts) / np.mean(prompts) ** 2)
    # second 108 is still open; the busiest closed one (103: 6,000 tokens) is read back within its bucket
    busiest = max(v for s, v in per_second.items() if s < 108)
    assert busiest == 6000
    assert busiest / 2 ** 0.5 <= obs.peak_prompt_tokens_per_s <= busiest * 2 ** 0.5


def test_the_decode_streams_mean_and_peaks_come_from_the_frontend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Streams start at their first token and end when they finish; each whole second passed
    samples the count held, and the interval reads back their mean and 90th percentile."""
    import numpy as np

    now = [200.0]
    monkeypatch.setattr("tokenmill.api.metrics.time.monotonic", lambda: now[0])
    m = _metrics()
    before = scrape(generate_latest(m.registry).decode())
    counts = [100] * 50 + [20] * 50  # streams held at seconds 201-250, then 251-300
    timers = []
    for t, n in (200.5, 100), (250.5, -80), (300.5, -20):
        now[0] = t
        if n > 0:
            for _ in range(n):
                timers.append(m.start_request(10))
                timers[-1].on_tokens(1)  # the first token: a stream
        else:
            for timer in timers[:-n]:
                timer.on_finish("success", 10, 5, 0)
            timers = timers[-n:]
    unstarted = m.start_request(10)  # no token: never a stream, and its end changes nothing
    unstarted.on_finish("error", 10, 0, 0)
    obs = observe(before, scrape(generate_latest(m.registry).decode()), at_s=300.0, interval_s=100.0,
                  workers=WORKERS, warmup_s=60.0)
    assert obs.streams_mean == pytest.approx(np.mean(counts))
    assert 91 <= obs.streams_p90 <= 108  # the 90th percentile, 100, read back within its bucket
    assert m.decode_streams.count == 0
