"""Engine flags refused before anything starts: exit 2 and one line naming the flag (vLLM's own
options are checked by its venv's interpreter, so a bad one is named by vLLM's own parser)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.engines_vllm.conftest import VLLM_PYTHON
from tests.serving.probes import child_pids
from tokenmill.procs import process_alive

CHECK_S = 120


def tokenmill(python: str | Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(python), "-m", "tokenmill.cli", *argv], capture_output=True, text=True,
                          timeout=CHECK_S)


@pytest.mark.parametrize("flags,named", [
    (["--engine", "sglang"], "--engine"),
    (["--engine-arg", "dtype=float32"], "--engine-arg"),
    (["--engine", "vllm", "--engine-arg", "no_such_option=1"], "--engine-arg no-such-option=1"),
    (["--engine", "vllm", "--engine-arg", "dtype"], "--engine-arg 'dtype'"),
    (["--engine", "vllm", "--engine-python", "/nonexistent/python"], "--engine-python /nonexistent/python"),
    (["--engine", "vllm", "--prefill", "1", "--decode", "1", "--kv-transfer-backends", "shm"],
     "--kv-transfer-backends shm"),
    (["--engine", "vllm", "--kv-host-gb", "1"], "--kv-host-gb"),
    (["--engine", "vllm", "--tp", "2"], "--tp"),
    (["--engine", "vllm", "--speculative", "ngram"], "--speculative"),
    (["--engine", "vllm", "--enforce-eager"], "--enforce-eager"),
])
def test_serve_refuses_bad_engine_flags_naming_them(small_llama: Path, flags: list[str], named: str) -> None:
    result = tokenmill(sys.executable, "serve", "--model", str(small_llama), "--port", "0",
                       "--engine-python", str(VLLM_PYTHON), *flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert named in lines[-1], lines
    if "--engine-python" not in named and named != "--engine":
        assert len(lines) == 1, lines  # one line, not vLLM's log nor a usage page


def test_a_missing_vllm_venv_says_how_to_install_it(small_llama: Path, tmp_path: Path) -> None:
    result = tokenmill(sys.executable, "serve", "--model", str(small_llama), "--engine", "vllm",
                       "--engine-python", "/nonexistent/python")
    assert result.returncode == 2
    assert "make install-vllm" in result.stderr
    # a worker started by an interpreter without vLLM (tokenmill's own venv) says the same
    result = tokenmill(sys.executable, "worker", "--model", str(small_llama), "--engine", "vllm",
                       "--discovery", f"file:{tmp_path / 'registry'}")
    assert result.returncode == 2 and "make install-vllm" in result.stderr, result.stderr


def test_a_sigterm_while_the_first_worker_takes_the_options_leaves_nothing_running(small_llama: Path,
                                                                                   tmp_path: Path) -> None:
    """serve holds its other workers until the first has taken vLLM's options (it imports vLLM for
    seconds first): stopped then, serve stops that worker too, and leaves nothing of it."""
    serve = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--model", str(small_llama), "--port",
                              "0", "--engine", "vllm", "--engine-python", str(VLLM_PYTHON)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + CHECK_S
        while not (workers := child_pids(serve.pid)):
            assert serve.poll() is None and time.monotonic() < deadline, "serve started no worker"
            time.sleep(0.05)
        [worker] = workers
        serve.send_signal(signal.SIGTERM)
        _, err = serve.communicate(timeout=CHECK_S)
    finally:
        serve.kill()
    assert serve.returncode == 128 + signal.SIGTERM, err
    assert not process_alive(worker)
    assert not list(Path(tempfile.gettempdir()).glob(f"tokenmill-{worker}-*")), "the worker's scratch was left"


# Each case is `tokenmill worker ... --check-only`: the options taken as a starting worker takes them
# (`_vllm_engine`), nothing started; serve's first worker does the same and its one line is passed on
# (the serve cases above). All of them run in one process of vLLM's venv: one vLLM import, not one a case.
WORKER_CASES: dict[str, list[str]] = {
    "good": ["--engine-arg", "enforce_eager=true", "--engine-arg", "max_num_seqs=8", "--",
             "--max-num-batched-tokens", "1024"],
    "block size 16": ["--block-size", "16"],
    "vLLM given another block size": ["--engine-arg", "block_size=64"],
    "a transfer connector of vLLM's": ["--role", "decode", "--engine-arg",
                                       'kv_transfer_config={"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
    "a bad value for vLLM's own parser": ["--", "--dtype", "float64"],
}

CHECKS = """
import argparse, contextlib, io, json, sys, tempfile
from pathlib import Path
from tokenmill.cli import main
from tokenmill.engines.vllm.config import EventEndpoints, engine_args_from
from tokenmill.worker.main import add_arguments
job = json.load(sys.stdin)
results = {}
for name, argv in job["cases"].items():
    split = argv.index("--") if "--" in argv else len(argv)  # vLLM's own flags stay last
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["--log-level", "WARNING", "worker", *job["common"], *argv[:split], "--check-only", *argv[split:]])
    results[name] = {"code": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
parser = argparse.ArgumentParser()
add_arguments(parser)
args = parser.parse_args([*job["common"], "--role", "decode", "--engine-arg", "kv_offloading_size=2"])
args.block_size = 32
config = engine_args_from(args, EventEndpoints.in_dir(Path(tempfile.mkdtemp()))).kv_transfer_config
results["composed"] = {"connector": config.kv_connector, "policy": config.kv_load_failure_policy,
                       "extra": config.kv_connector_extra_config}
with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


@pytest.fixture(scope="module")
def worker_checks(small_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Every case of WORKER_CASES (and the composed connectors below), run in one vLLM-venv process."""
    run_dir = tmp_path_factory.mktemp("worker-checks")
    common = ["--model", str(small_llama), "--engine", "vllm", "--discovery", f"file:{run_dir / 'registry'}"]
    job = json.dumps({"common": common, "cases": WORKER_CASES})
    done = subprocess.run([str(VLLM_PYTHON), "-c", CHECKS, str(run_dir / "results.json")], input=job,
                          capture_output=True, text=True, timeout=CHECK_S)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run_dir / "results.json").read_text())


def test_the_worker_accepts_good_vllm_options(worker_checks: dict[str, dict]) -> None:
    good = worker_checks["good"]
    assert good["code"] == 0, good["stderr"][-2000:]
    assert "accepted" in good["stdout"]


@pytest.mark.parametrize(("case", "named"), [
    ("block size 16", "--block-size 16"),
    ("vLLM given another block size", "--block-size 32"),
    ("a transfer connector of vLLM's", "--engine-arg kv_transfer_config"),
    ("a bad value for vLLM's own parser", "--dtype"),
])
def test_the_worker_refuses_options_vllm_would_run_wrongly(worker_checks: dict[str, dict], case: str,
                                                          named: str) -> None:
    result = worker_checks[case]
    errors = [line for line in result["stderr"].splitlines() if line.startswith("error:")]
    assert result["code"] == 2 and len(errors) == 1 and named in errors[0], result["stderr"][-2000:]


def test_a_decode_worker_with_vllm_offload_runs_both_connectors(worker_checks: dict[str, dict]) -> None:
    """vLLM would replace the transfer connector with its offloading one: the worker composes both
    in vLLM's MultiConnector instead (its offload itself runs on CUDA hosts only; see docs/vllm.md)."""
    config = worker_checks["composed"]
    assert config["connector"] == "MultiConnector" and config["policy"] == "recompute"
    first, second = config["extra"]["connectors"]
    assert first["kv_connector"] == "TokenmillConnector" and first["kv_connector_extra_config"]["worker_id"]
    assert second == {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                      "kv_connector_extra_config": {"cpu_bytes_to_use": 2 * (1 << 30)}}
