"""The own engine's OpenMP tuning: set only where the user set nothing, and removed for an outside
engine without touching a user's own setting."""
from __future__ import annotations

from tokenmill.openmp_env import MARK, OWN_ENGINE, tune_for_own_engine, untune


def test_tuning_fills_only_what_the_user_left_unset_and_untune_removes_only_that() -> None:
    env = {"PATH": "/bin"}
    tune_for_own_engine(env)
    assert env["GOMP_SPINCOUNT"] == OWN_ENGINE["GOMP_SPINCOUNT"] and MARK in env
    tune_for_own_engine(env)  # a tokenmill process started by another: unchanged
    assert env[MARK] == "GOMP_SPINCOUNT"
    untune(env)
    assert env == {"PATH": "/bin"}


def test_a_users_own_setting_wins_and_survives_untune() -> None:
    env = {"GOMP_SPINCOUNT": "500"}
    tune_for_own_engine(env)
    assert env == {"GOMP_SPINCOUNT": "500"}
    untune(env)
    assert env == {"GOMP_SPINCOUNT": "500"}
    # a user who sets tokenmill's very value after a tokenmill parent marked it keeps it too
    env = {"GOMP_SPINCOUNT": "20000", MARK: "GOMP_SPINCOUNT"}
    env["GOMP_SPINCOUNT"] = "999"
    untune(env)
    assert env == {"GOMP_SPINCOUNT": "999"}
