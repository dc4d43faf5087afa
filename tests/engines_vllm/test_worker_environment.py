"""The environment a vLLM worker gives vLLM's processes before they start; a user's setting wins."""
from __future__ import annotations

import argparse
import os

import pytest

from tokenmill.engines.vllm import config

ONE_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"
BIND = "VLLM_CPU_OMP_THREADS_BIND"


def environment_of(monkeypatch: pytest.MonkeyPatch, given: dict[str, str], cuda: bool = False,
                   threads: int | None = None) -> dict[str, str]:
    """What `_apply_environment` leaves, starting from `given` alone (os.environ is swapped for the test)."""
    environ = dict(given)
    monkeypatch.setattr(os, "environ", environ)
    monkeypatch.setattr(config, "_has_cuda", lambda: cuda)
    config._apply_environment(argparse.Namespace(threads=threads))
    return environ


def test_on_a_cpu_the_model_runs_in_the_engine_core_unbound(monkeypatch: pytest.MonkeyPatch) -> None:
    env = environment_of(monkeypatch, {}, threads=2)
    assert (env[BIND], env[ONE_PROCESS], env["OMP_NUM_THREADS"]) == ("nobind", "0", "2")


def test_without_threads_the_model_gets_every_core_as_the_own_engine_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # unset, vLLM's worker would serve on one torch thread
    monkeypatch.setattr(config, "_torch_threads", lambda: 5)  # torch's default, as the own engine takes it
    assert environment_of(monkeypatch, {})["OMP_NUM_THREADS"] == "5"
    assert environment_of(monkeypatch, {"OMP_NUM_THREADS": "3"})["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("given", [{BIND: "0-1"}, {BIND: "auto"}, {ONE_PROCESS: "1"}])
def test_a_core_binding_or_the_users_choice_keeps_the_multiprocess_executor(monkeypatch: pytest.MonkeyPatch,
                                                                             given: dict[str, str]) -> None:
    env = environment_of(monkeypatch, given)
    assert env.get(ONE_PROCESS) == given.get(ONE_PROCESS)  # vLLM's executor pins a bound worker's threads
    assert ("OMP_NUM_THREADS" in env) == (BIND not in given)  # a binding sets the count for its cores
    assert env[BIND] == given.get(BIND, "nobind")


def test_a_cuda_host_keeps_vllms_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    env = environment_of(monkeypatch, {}, cuda=True)
    assert ONE_PROCESS not in env and "OMP_NUM_THREADS" not in env
