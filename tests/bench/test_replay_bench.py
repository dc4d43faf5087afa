"""`tokenmill bench replay`'s flags: a bad one exits 2, naming it, before any server starts (the
bench itself starts two `serve` runs: it is measured in the closing notes, not here)."""
from __future__ import annotations

import logging

import pytest

from tokenmill.bench.serving.replay_bench import requests
from tokenmill.cli import main


@pytest.mark.parametrize("flags,named", [
    (["--sides", "deterministic,fast"], "--sides"), (["--sides", ","], "--sides"), (["--requests", "0"], "--requests"),
    (["--concurrency", "-1"], "--concurrency"), (["--workers", "0"], "--workers")])
def test_a_bad_flag_exits_2_naming_it(flags: list[str], named: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.ERROR):
        assert main(["bench", "replay", *flags]) == 2
    [error] = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert named in error


def test_the_requests_are_seeded_and_a_third_share_a_prefix() -> None:
    bodies = requests(30)
    assert bodies == requests(30)  # the same requests on both sides
    assert [b["seed"] for b in bodies] == list(range(1000, 1030))
    shared = bodies[0]["prompt"][:96]
    assert [i for i, b in enumerate(bodies) if b["prompt"][:96] == shared] == list(range(0, 30, 3))
