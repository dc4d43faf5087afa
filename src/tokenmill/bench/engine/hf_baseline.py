"""The transformers baseline: the same workload through `AutoModelForCausalLM.generate()`.

Requests are batched in arrival order, left-padded, decoded greedily. `generate` runs a
batch until its longest request is done (`min_new_tokens = max_new_tokens` = the batch's
largest requested output, so EOS cannot end it early); only each request's own requested
tokens are useful, so the rate counts those alone.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class HFResult:
    useful_output_tokens_per_s: float
    requests_run: int
    requests_total: int
    wall_s: float
    batch_size: int
    num_batches: int
    useful_output_tokens: int
    generated_tokens: int
    mean_step_ms: float


def run_hf_baseline(model_dir: str, dtype_name: str, prompts: list[list[int]], output_lens: list[int],
                    batch_size: int, max_requests: int | None) -> HFResult:
    """Time whole batches covering the first `max_requests` requests (all when None)."""
    model, pad_id = _load(model_dir, dtype_name)
    _generate_batch(model, [prompts[0][:8]], 2, pad_id)  # warm-up: first-call allocations
    limit = len(prompts) if max_requests is None else min(max_requests, len(prompts))
    starts = list(range(0, limit, batch_size))
    useful = generated = steps = 0
    t0 = time.perf_counter()
    for start in starts:
        batch_prompts = prompts[start:start + batch_size]
        batch_outputs = output_lens[start:start + batch_size]
        max_new = max(batch_outputs)
        _generate_batch(model, batch_prompts, max_new, pad_id)
        useful += sum(batch_outputs)
        generated += max_new * len(batch_prompts)
        steps += max_new
        log.info("transformers: batch %d/%d done (%d requests, %d new tokens each)",
                 start // batch_size + 1, len(starts), len(batch_prompts), max_new)
    wall = time.perf_counter() - t0
    requests_run = min(len(prompts), starts[-1] + batch_size)
    return HFResult(
        useful_output_tokens_per_s=useful / wall, requests_run=requests_run, requests_total=len(prompts),
        wall_s=wall, batch_size=batch_size, num_batches=len(starts), useful_output_tokens=useful,
        generated_tokens=generated, mean_step_ms=wall / steps * 1e3,
    )


def _load(model_dir: str, dtype_name: str) -> tuple[Any, int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name))
    model.eval()
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id
    if isinstance(pad, list):
        pad = pad[0]
    return model, int(pad if pad is not None else 0)


def _generate_batch(model: Any, prompts: list[list[int]], max_new: int, pad_id: int) -> None:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt):] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)
    if out.shape[1] - width != max_new:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, expected {max_new}")
