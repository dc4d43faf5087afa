"""OpenMP settings for tokenmill's own engine, and the environment an outside engine gets instead.

    tune_for_own_engine(os.environ)   # the CLI, before any sub-command imports torch
    untune(env)                       # before a vLLM process starts: vLLM's own defaults

The native kernels (`engine/kernels`) run on torch's OpenMP pool, between torch's own ops. GNU
OpenMP's workers spin a while after each parallel region before they sleep; from sleep, waking
them costs more than a small kernel's whole run. 20,000 spins keep them awake across the gaps of
a decode step (SmolLM2 on 2 cores: 62 ms a step, against 73 ms at 5,000 and 75 ms when they
never spin) without holding a core for long once a step ends (two engines sharing those 2 cores
measured 1.5% slower a step than with no spinning). OpenMP reads this when torch loads it, so it
is set before, and a user's own setting always wins.
"""
from __future__ import annotations

from collections.abc import MutableMapping

OWN_ENGINE = {"GOMP_SPINCOUNT": "20000"}
MARK = "TOKENMILL_OPENMP_SET"  # the keys tokenmill set (not the user), comma-separated


def tune_for_own_engine(env: MutableMapping[str, str]) -> None:
    set_here = [key for key in OWN_ENGINE if key not in env]
    for key in set_here:
        env[key] = OWN_ENGINE[key]
    if set_here:
        env[MARK] = ",".join(sorted({*env.get(MARK, "").split(","), *set_here} - {""}))


def untune(env: MutableMapping[str, str]) -> None:
    """Remove what `tune_for_own_engine` set (a user's own settings stay)."""
    for key in env.pop(MARK, "").split(","):
        if key in OWN_ENGINE and env.get(key) == OWN_ENGINE[key]:
            del env[key]
