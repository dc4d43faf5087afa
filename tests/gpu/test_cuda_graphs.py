"""The own engine on a GPU: decode steps replayed from CUDA graphs give the tokens and logits of the
same steps launched op by op."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tests.engine.helpers import GREEDY, make_engine, prompts
from tokenmill.engine.runner import StepPart


def test_graphed_decoding_gives_the_eager_greedy_text(tiny_dense: Path) -> None:
    graphed = make_engine(tiny_dense, device="cuda", max_num_seqs=12)
    eager = make_engine(tiny_dense, device="cuda", max_num_seqs=12, enforce_eager=True)
    assert graphed.runner.graphs is not None and eager.runner.graphs is None
    batch = prompts(graphed, 12, seed=7)
    assert graphed.generate(batch, GREEDY) == eager.generate(batch, GREEDY)
    assert graphed.runner.graphs.replayed > 0 and graphed.runner.graphs.steps


def test_a_replayed_step_gives_the_eager_logits(tiny_dense: Path) -> None:
    engine = make_engine(tiny_dense, device="cuda", num_kv_blocks=64)
    runner = engine.runner
    parts = [StepPart([7 + i], 20 + 9 * i, np.arange(3 * i, 3 * i + 3), True, 1) for i in range(3)]
    step = runner.step_inputs(parts)
    torch.manual_seed(0)
    runner.kv_cache.normal_()
    want = runner.forward(*runner.to_device(*step)).cpu()
    first = runner.graphs.run(*step).cpu()  # captured now
    again = runner.graphs.run(*step).cpu()  # replayed
    assert torch.allclose(first, want, atol=1e-4) and torch.equal(first, again)
