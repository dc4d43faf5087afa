"""tokenmill's forward pass against transformers' on the same checkpoint directory."""
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.helpers import GREEDY, make_engine, prompt_logits, prompts


@pytest.mark.parametrize("preset", ["tiny-dense", "tiny-moe", "tiny-llama"])
def test_logits_and_greedy_continuations_match_transformers(model_dirs: dict[str, Path], preset: str) -> None:
    engine = make_engine(model_dirs[preset])
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[preset], dtype=torch.float32).eval()
    batch = prompts(engine, 3, seed=1, low=20, high=200)
    for tokens in batch:
        with torch.no_grad():
            ref = hf(torch.tensor([tokens])).logits[0].float()
        ours = prompt_logits(engine, tokens)
        assert (ours - ref).abs().max().item() <= 1e-4
    outs = engine.generate(batch, GREEDY)
    for tokens, out in zip(batch, outs):
        with torch.no_grad():
            ref_ids = hf.generate(torch.tensor([tokens]), attention_mask=torch.ones(1, len(tokens), dtype=torch.long),
                                  max_new_tokens=64, do_sample=False, eos_token_id=None)[0, len(tokens):]
        assert out == ref_ids.tolist()


def test_bfloat16_runs_and_mostly_agrees_with_fp32(tiny_moe: Path) -> None:
    fp32 = make_engine(tiny_moe)
    bf16 = make_engine(tiny_moe, dtype="bfloat16")
    tokens = prompts(fp32, 1, seed=2, low=40, high=41)[0]
    a, b = prompt_logits(fp32, tokens), prompt_logits(bf16, tokens)
    agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
    assert agree >= 0.8
