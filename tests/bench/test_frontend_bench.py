"""`tokenmill bench frontend`'s parts, fast: the wrk script and result line, the /proc readings,
finding a serving tree's processes, the targets. No server is started and nothing is timed."""
from __future__ import annotations

import json
import os
import subprocess
import time

import pytest

from tokenmill.bench.harness import frontend_procs as procs
from tokenmill.bench.serving.frontend_bench import bodies
from tokenmill.bench.serving.frontend_report import TARGETS, LoadResult, target_checks
from tokenmill.bench.serving.frontend_wrk import lua_long_string, lua_script, parse_result

GOOD_LINE = ('TM_RESULT {"requests": 1200, "duration_us": 2000000, "bytes": 480000, "p50_us": 1500.0, '
             '"p90_us": 2500.5, "p99_us": 9000.0, "mean_us": 1800.2, "max_us": 12000.0, '
             '"connect": 0, "read": 1, "write": 0, "timeout": 2, "status": 3}')


def test_lua_script_posts_the_json_body() -> None:
    body = bodies(16)["streaming"]
    script = lua_script(body)
    assert 'wrk.method = "POST"' in script
    assert 'wrk.headers["Content-Type"] = "application/json"' in script
    assert f"wrk.body = [[{json.dumps(body)}]]" in script
    assert '"stream": true' in script and '"ignore_eos": true' in script and '"max_tokens": 16' in script
    assert "function done(summary, latency, requests)" in script and "TM_RESULT {" in script
    assert "$" not in script  # every placeholder was substituted


def test_lua_long_string_outlevels_its_content() -> None:
    assert lua_long_string('{"p": "a]]b"}') == '[=[{"p": "a]]b"}]=]'
    assert lua_long_string("x]=]y]]") == "[==[x]=]y]]]==]"


def test_parse_result_reads_the_last_tagged_line() -> None:
    output = "Running 2s test @ http://127.0.0.1:1/v1/completions\n  Latency 1.5ms\n" + GOOD_LINE + "\n"
    result = parse_result(output)
    assert result.requests == 1200 and result.duration_s == 2.0 and result.bytes == 480000
    assert result.latency_us["p99_us"] == 9000.0
    assert result.errors == {"connect": 0, "read": 1, "write": 0, "timeout": 2, "status": 3}
    assert result.ok_requests == 1197 and result.total_errors == 6


@pytest.mark.parametrize("output, message", [
    ("Running 2s test\nRequests/sec: 10\n", "no TM_RESULT line"),
    ('TM_RESULT {"requests": 12, "duration_us": \n', "malformed TM_RESULT line"),
    ("TM_RESULT [1, 2]\n", "not a JSON object"),
    ('TM_RESULT {"requests": 12}\n', "missing duration_us"),
    (GOOD_LINE.replace('"bytes": 480000', '"bytes": "many"'), "non-numeric"),
])
def test_parse_result_rejects_malformed_output(output: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_result(output)


def test_load_result_splits_cpu_per_thousand_ok_requests() -> None:
    result = LoadResult.of(parse_result(GOOD_LINE), cpu_frontend=0.9, cpu_workers=0.3)
    assert result.ok_requests == 1197 and result.requests_per_s == pytest.approx(598.5)
    assert result.cpu_s_per_1k_requests == pytest.approx(1.2 / 1197 * 1000)
    assert result.frontend_share == pytest.approx(0.75) and result.workers_share == pytest.approx(0.25)
    assert result.latency_ms_p50 == 1.5


def test_targets_report_met_and_miss() -> None:
    report = {"runs": {"non_streaming": {"requests_per_s": 3000.0, "cpu_s_per_1k_requests": 0.7},
                       "streaming": {"requests_per_s": 900.0, "cpu_s_per_1k_requests": None}},
              "startup": {"first_200_s": 1.5}, "idle_rss": {"total_mib": 601.0}}
    met = {name: check["met"] for name, check in target_checks(report, TARGETS).items()}
    assert met == {"non_streaming_requests_per_s": True, "streaming_requests_per_s": False,
                   "non_streaming_cpu_s_per_1k_requests": False, "streaming_cpu_s_per_1k_requests": None,
                   "startup_s": True, "idle_rss_mib": False}


def test_cpu_seconds_grow_with_busy_work() -> None:
    me = os.getpid()
    before = procs.cpu_snapshot([me])[me]
    deadline = time.process_time() + 0.15
    while time.process_time() < deadline:
        pass  # burn CPU: the snapshot's clock ticks are 10 ms
    after = procs.cpu_snapshot([me])[me]
    assert after - before >= 0.1
    totals = procs.cpu_by_role({me: before}, {me: after}, {me: procs.WORKER})
    assert totals[procs.WORKER] == pytest.approx(after - before) and totals[procs.FRONTEND] == 0.0


def test_rss_of_this_process_and_of_none() -> None:
    assert procs.rss_kib(os.getpid()) > 1024  # an interpreter with pytest loaded: well over 1 MiB
    assert procs.rss_kib(2**22 + 1) is None  # above the default pid_max: never a live process


def test_descendants_include_a_child_in_its_own_session() -> None:
    child = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        me = os.getpid()
        assert os.getpgid(child.pid) != os.getpgid(me)  # the process group would miss it
        assert child.pid in procs.descendants(me)
        roles = procs.classify(me, [child.pid])
        assert roles[me] == procs.FRONTEND and roles[child.pid] == procs.WORKER
        assert procs.classify(me, [])[child.pid] == procs.FRONTEND  # unregistered: the frontend's own
    finally:
        child.kill()
        child.wait()
