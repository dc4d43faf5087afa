"""`tokenmill bench demo`'s pieces that need no server: its flags, the scenarios' requests (seeded,
sized to the context, the trial's turns sharing the corpus and each agent's earlier turns), and the
fleet simulator's replay of a run."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from tokenmill.bench.demo.demo_bench import add_arguments
from tokenmill.bench.demo.demo_report import simulate_run
from tokenmill.cli import main
from tokenmill.textgen.tokenizer import Tokenizer
from tokenmill.workloads.demo import scenario_specs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("flags,message", [
    (["--scenarios", "poker"], "--scenarios"), (["--workers", "1"], "--workers"),
    (["--duration-s", "0"], "--duration-s"), (["--model", "/nowhere"], "--model"),
])
def test_bad_flags_exit_2_naming_the_flag(tiny_dense: Path, flags: list[str], message: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "demo", "--model", str(tiny_dense), *flags]) == 2
    assert message in capsys.readouterr().out


def test_the_trial_turns_share_the_corpus_and_each_agent_its_history(tiny_dense: Path) -> None:
    tokenizer = Tokenizer(str(tiny_dense))
    def encode(messages: list) -> list[int]:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    warmup, turns = scenario_specs("trial", 3, 2.0, 30.0, encode, count, 2048)
    again = scenario_specs("trial", 3, 2.0, 30.0, encode, count, 2048)
    assert [s.prompt for s in again[1]] == [s.prompt for s in turns]  # seeded
    assert len(warmup) == 8 and all(s.arrival_s is None for s in warmup)
    assert 30 <= len(turns) <= 90 and all(0 < s.arrival_s < 30 for s in turns)  # Poisson at 2/s
    assert all(len(s.prompt) + s.output_len <= 2048 for s in warmup + turns)
    corpus = min(_common_prefix(a.prompt, b.prompt) for a, b in zip(warmup, warmup[1:]))
    assert corpus > 500  # the protocol every agent reads
    first, later = warmup[0].prompt, turns[0].prompt  # agent 0's warm-up turn, then its next one
    assert _common_prefix(first, later) > corpus + 100  # its own history reused too
    risk_warmup, risk = scenario_specs("risk", 3, 2.0, 10.0, encode, count, 2048)
    assert not risk_warmup and max(_common_prefix(a.prompt, b.prompt) for a, b in zip(risk, risk[1:])) < 64


def test_the_simulator_replays_a_run_in_the_live_seconds(tiny_dense: Path) -> None:
    tokenizer = Tokenizer(str(tiny_dense))
    warmup, turns = scenario_specs("trial", 1, 1.0, 20.0, lambda m: tokenizer.apply_chat_template(m),
                                   lambda t: len(tokenizer.encode(t)), 2048)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_dense), "--mock", "llama-3.1-8b@h100:fp8:tp1"])
    # a run 10x slower on the wall clock at speed-up 1 is the same modelled run as this one at speed-up 10
    stretched = [dataclasses.replace(s, arrival_s=10 * s.arrival_s) for s in turns]
    slow = simulate_run(warmup, stretched, 50.0, "+ KV routing", args)
    args.mock_speedup = 10.0
    fast = simulate_run(warmup, turns, 5.0, "+ KV routing", args)
    assert slow["requests"] == slow["finished"] == len(turns)
    assert 0 < slow["ttft_mean_ms"] < 10_000 and slow["itl_mean_p50_ms"] > 0
    for key in ("ttft_mean_ms", "ttft_p90_ms", "itl_mean_p99_ms"):
        assert fast[key] == pytest.approx(slow[key] / 10, rel=1e-6)
