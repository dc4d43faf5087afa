"""Model runners: turn a scheduled step into sampled tokens.

The scheduler and KV cache are the same for every runner; only the forward pass
differs. `TorchModelRunner` runs the real model on the paged KV cache.
"""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from tokenmill.engine.attention import AttentionBatch, SeqSpan, allocate_kv_cache
from tokenmill.engine.model_config import ModelConfig
from tokenmill.engine.models.transformer import CausalLM
from tokenmill.engine.sampling import SampleRow, TokenLogprob, sample
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.kv.cache_manager import KVCacheManager

Sampled = dict[str, tuple[int, TokenLogprob | None]]


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        """Compute the step; return a token for every request whose step reached its end."""
        ...


class TorchModelRunner:
    def __init__(self, model: CausalLM, cfg: ModelConfig, num_blocks: int, block_size: int,
                 dtype: torch.dtype, seed: int = 0) -> None:
        self.model = model
        self.block_size = block_size
        self.kv_cache = allocate_kv_cache(cfg.num_layers, num_blocks, block_size,
                                          cfg.num_kv_heads, cfg.head_dim, dtype)
        self.generator = torch.Generator().manual_seed(seed)

    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        input_ids, positions, batch, logits_rows = self._prepare(out, kv)
        logits = self.model(input_ids, positions, self.kv_cache, batch, logits_rows)
        sampling = [s for s in out.seqs if s.samples]
        rows = [SampleRow(s.request.params, len(s.request.output_token_ids)) for s in sampling]
        tokens, logprobs = sample(logits, rows, self.generator)
        return {s.request.request_id: (t, lp) for s, t, lp in zip(sampling, tokens, logprobs)}

    def _prepare(self, out: SchedulerOutput, kv: KVCacheManager) -> tuple[
            torch.Tensor, torch.Tensor, AttentionBatch, torch.Tensor]:
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        spans: list[SeqSpan] = []
        logits_rows: list[int] = []
        bs = self.block_size
        for seq in out.seqs:
            end = seq.start + seq.num_tokens
            blocks = np.asarray(kv.block_ids(seq.request.request_id)[: -(-end // bs)], dtype=np.int64)
            pos = np.arange(seq.start, end, dtype=np.int64)
            spans.append(SeqSpan(len(ids), seq.num_tokens, end, torch.from_numpy(blocks)))
            ids.extend(seq.request.token_ids[seq.start:end])
            positions.append(pos)
            slots.append(blocks[pos // bs] * bs + pos % bs)
            if seq.samples:
                logits_rows.append(len(ids) - 1)
        batch = AttentionBatch(torch.from_numpy(np.concatenate(slots)), spans)
        return (torch.tensor(ids, dtype=torch.long), torch.from_numpy(np.concatenate(positions)),
                batch, torch.tensor(logits_rows, dtype=torch.long))
