"""A draft model for speculative decoding: a small model with the target's vocabulary proposes
each request's next tokens greedily, on a paged KV pool of its own.

    draft = DraftModel.load(dir, dtype, num_blocks, block_size, max_model_len, chunk_tokens, device)
    draft.retain(live_request_ids)               # forget finished requests, free their blocks
    draft.release(request_id)                    # or one (aborted between steps)
    drafts = draft.propose([(request, k), ...])  # request id -> up to k greedy tokens

A request's state here is its blocks and `computed`, how many of its leading tokens have their
K/V in this pool, plus `fed`, the drafts whose K/V was written after them. Drafting k tokens for
a request of n tokens runs k batched forward passes of the draft model:

    pass 0:      the tokens computed..n-1 (the whole prompt the first time, then the 1 or 2
                 tokens the target emitted past what was fed) -> d_1 = argmax of the last row
    pass i>0:    d_i at position n+i-1 -> d_{i+1}

so afterwards computed = n and fed = d_1..d_{k-1}. The next time, the request's tokens past n
are the drafts the target accepted and then its own token; the fed drafts that match them keep
their K/V (computed grows by that many) and the rest is overwritten. Greedy drafts are point
masses, so the target's verification (`engine/speculative.py`) keeps its distribution exactly
whatever the draft model is. Blocks are allocated per request (no prefix sharing: a draft pool
of the target's size may run short where the target shares prefixes); a request the pool cannot
hold, or longer than the draft model's context, gets no drafts: the plain return of a failed
allocation.
"""
from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.engine.runner import StepPart, TorchModelRunner
from tokenmill.engine.sampler import argmax_rows
from tokenmill.engine.speculative import MAX_SPECULATIVE_TOKENS
from tokenmill.engine.weights import load_model
from tokenmill.textgen.model_config import load_model_config


@dataclass(slots=True)
class DraftState:
    blocks: list[int] = field(default_factory=list)
    computed: int = 0  # leading tokens of the request whose K/V this pool holds
    fed: list[int] = field(default_factory=list)  # drafts written after them, in order


class DraftModel:
    def __init__(self, runner: TorchModelRunner, num_blocks: int, chunk_tokens: int, max_positions: int) -> None:
        """`chunk_tokens`: the most context tokens one `propose` catches up on (the target's
        step budget, so a long prompt's draft prefill is spread over steps like its own).
        `max_positions`: the draft model's context; a longer request gets no drafts."""
        self.runner = runner
        self.chunk_tokens = chunk_tokens
        self.max_positions = max_positions
        self.block_size = runner.block_size
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # popped from the end: lowest first
        self.num_blocks = num_blocks
        self.states: dict[str, DraftState] = {}

    @classmethod
    def load(cls, model_dir: str, dtype: torch.dtype, num_blocks: int, block_size: int, max_model_len: int,
             chunk_tokens: int, device: str = "cpu") -> DraftModel:
        """The draft checkpoint at the target's dtype and device, with a pool of `num_blocks`
        blocks (as many tokens as the target's pool holds)."""
        cfg = load_model_config(model_dir)
        positions = min(max_model_len, cfg.max_position_embeddings, cfg.sliding_window or max_model_len)
        model = load_model(model_dir, cfg, dtype, positions, device=device)
        runner = TorchModelRunner(model, cfg, num_blocks, block_size, dtype, device=device)
        return cls(runner, num_blocks, chunk_tokens, positions)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def retain(self, live: Container[str]) -> None:
        for request_id in [r for r in self.states if r not in live]:
            self.release(request_id)

    def release(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None:
            self.free_blocks += reversed(state.blocks)

    def propose(self, wants: list[tuple[Request, int]]) -> dict[str, list[int]]:
        """Up to k greedy drafts for each (request, k). A request whose context this pool has yet
        to catch up on past what is left of `chunk_tokens` (a prompt, the first time) only feeds
        a chunk of it this time, and drafts once it has caught up, as the target chunks prefill."""
        held = [(r, k) for r, k in wants if self._hold(r, k)]
        budget, drafting, feeds, chunks = self.chunk_tokens, [], [], []
        for request, k in held:
            start = self.states[request.request_id].computed
            ids = request.token_ids[start:]
            # the few tokens of a request that has caught up are not charged to the budget, so
            # decoding requests never starve a new prompt's catch-up
            if len(ids) > 1 + MAX_SPECULATIVE_TOKENS:
                if len(ids) > budget:
                    if budget > 0:
                        chunks.append((request, ids[:budget], start, 0))
                        self.states[request.request_id].computed += budget
                    budget = 0
                    continue
                budget -= len(ids)
            drafting.append((request, k))
            feeds.append((request, ids, start, 1))
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _ in drafting}
        for i in range(max((k for _, k in drafting), default=0)):
            for (request, *_), token in zip(feeds, self._greedy(feeds + chunks)):
                drafts[request.request_id].append(token)
            feeds = [(r, drafts[r.request_id][-1:], r.num_tokens + i, 1) for r, k in drafting if k > i + 1]
            chunks = []
        if chunks:  # only catching up this time
            self._greedy(chunks)
        for request, k in drafting:
            state = self.states[request.request_id]
            state.computed, state.fed = request.num_tokens, drafts[request.request_id][:k - 1]
        return drafts

    def _hold(self, request: Request, k: int) -> bool:
        """Resync the request's state with its tokens and give it the blocks for k - 1 fed drafts
        past them; False (and no drafts) when the pool cannot, or the draft model's context ends
        before them."""
        state = self.states.setdefault(request.request_id, DraftState())
        tokens = request.token_ids
        matched = 0
        while matched < len(state.fed) and state.computed + matched < len(tokens) \
                and state.fed[matched] == tokens[state.computed + matched]:
            matched += 1
        # at least one token is fed, so its row gives the first draft's logits
        state.computed = min(state.computed + matched, len(tokens) - 1)
        state.fed = []
        if len(tokens) + k - 1 > self.max_positions:  # it only grows: it will not fit again
            self.release(request.request_id)
            return False
        need = -(-(len(tokens) + k - 1) // self.block_size) - len(state.blocks)
        if need > len(self.free_blocks):
            return False
        state.blocks += [self.free_blocks.pop() for _ in range(max(0, need))]
        return True

    def _greedy(self, feeds: list[tuple[Request, list[int], int, int]]) -> list[int]:
        """One forward pass writing each (request, ids, start, logits)'s tokens at positions
        start..; the argmax of the last row of each with logits 1. A few tokens past a held
        context go through the decode kernel (a lone query each), a prompt as one causal span."""
        parts = [StepPart(ids, start, np.asarray(self.states[r.request_id].blocks, dtype=np.int64),
                          start > 0 and len(ids) <= MAX_SPECULATIVE_TOKENS + 1, logits)
                 for r, ids, start, logits in feeds]
        runner = self.runner
        logits = runner.forward(*runner.to_device(*runner.step_inputs(parts)))
        return argmax_rows(logits).tolist()
