"""Tensor- and expert-parallel workers (two rank processes on a gloo group) against the
single-process engine and transformers, their shutdown, and a rank killed mid-run."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import GREEDY, make_engine, prompt_logits, prompts
from tokenmill.engine.parallel.ranks import ParallelRunner
from tokenmill.engine.speculative import SpeculativeConfig
from tokenmill.textgen.sampling import SamplingParams

# the last two also speculate: a parallel target verifies drafts as one process does
LAYOUTS = [("tiny-dense", 2, 1, 1, None), ("tiny-llama", 2, 1, 1, None), ("tiny-moe", 2, 1, 1, None),
           ("tiny-moe", 1, 2, 1, None), ("tiny-moe", 2, 2, 1, "ngram"), ("tiny-moe", 1, 2, 2, "draft")]


@pytest.mark.parametrize(("preset", "tp", "ep", "dp", "drafts"), LAYOUTS,
                         ids=[f"{p}-tp{t}-ep{e}" + (f"-dp{d}" if d > 1 else "") + (f"-{s}" if s else "")
                              for p, t, e, d, s in LAYOUTS])
def test_parallel_logits_and_outputs_match_one_process_and_transformers(model_dirs: dict[str, Path], preset: str,
                                                                        tp: int, ep: int, dp: int,
                                                                        drafts: str | None) -> None:
    single = make_engine(model_dirs[preset])
    spec = None if drafts is None else SpeculativeConfig.parse(
        "ngram" if drafts == "ngram" else f"draft:{model_dirs[preset]}", 4)
    parallel = make_engine(model_dirs[preset], tp=tp, ep=ep, attention_dp=dp, speculative=spec)
    try:
        assert isinstance(parallel.runner, ParallelRunner)
        hf = AutoModelForCausalLM.from_pretrained(model_dirs[preset], dtype=torch.float32).eval()
        tokens = prompts(single, 1, seed=4, low=30, high=90)[0]
        ours = prompt_logits(parallel, tokens)
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float()
        assert (ours - prompt_logits(single, tokens)).abs().max().item() <= 1e-4
        assert (ours - ref).abs().max().item() <= 1e-4
        # mixed lengths batched together, decoding 64 tokens each, chunked prefill included
        batch = prompts(single, 4, seed=6)
        assert parallel.generate(batch, GREEDY) == single.generate(batch, GREEDY)
        assert spec is None or parallel.stats().spec_accepted_tokens > 0
        procs = parallel.runner.ranks.procs
    finally:
        parallel.close()
    assert [p.returncode for p in procs] == [0]


def test_a_killed_rank_fails_the_worker_instead_of_hanging(tiny_moe: Path) -> None:
    """SIGKILL of rank 1: rank 0's next step raises within the group's timeout (the peer's
    process is found gone), and closing afterwards leaves no process behind."""
    engine = make_engine(tiny_moe, tp=2)
    proc = engine.runner.ranks.procs[0]
    try:
        batch = prompts(engine, 2, seed=8)
        engine.generate(batch, GREEDY)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        started = time.monotonic()
        with pytest.raises(RuntimeError):
            engine.generate(batch, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert time.monotonic() - started < 60  # the group's timeout, not forever
    finally:
        engine.close()
    assert proc.returncode == -signal.SIGKILL
