"""The batched sampler over a step's logits.

Randomness is stateless per token: a request with a seed draws token k from a
generator seeded by (seed, k), so the same seed gives the same tokens whatever
the batch, and a preempted or migrated request continues the same stream.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.textgen.sampling import SampleRow, TokenLogprob


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator,
           allowed: tuple[list[int], torch.Tensor] | None = None) -> tuple[list[int], list[TokenLogprob | None]]:
    """One token per row of fp32 `logits` [rows, vocab]. `allowed`: (row indices, [k, vocab] bool)
    restricts those rows to the tokens their grammars allow. Logprobs are the model's (after
    penalties), not renormalised over the allowed tokens."""
    if any(r.params.penalised for r in rows):
        logits = apply_penalties(logits, rows)
    scores = logits
    if allowed is not None:
        logits = _restrict(logits, *allowed)
    tokens = argmax_rows(logits)
    random_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if random_rows:
        idx = torch.tensor(random_rows)
        tokens[idx] = _sample_random(logits.index_select(0, idx), [rows[i] for i in random_rows], generator)
    token_list = tokens.tolist()
    return token_list, _logprobs(scores, rows, token_list)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first index on ties. Through max(): on CPU, argmax over a vocabulary
    is several times slower (one thread, not vectorised), about half a millisecond a step."""
    return x.max(dim=-1).indices


def _restrict(logits: torch.Tensor, row_index: list[int], allowed: torch.Tensor) -> torch.Tensor:
    logits = logits.clone()
    rows_t = torch.tensor(row_index)
    logits[rows_t] = logits.index_select(0, rows_t).masked_fill(~allowed[:, :logits.shape[1]], float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Penalties and biases for the whole batch at once: token counts come from one bincount over
    the penalised rows' tokens, so the cost grows with the tokens, not with Python work per row."""
    logits = logits.clone()
    vocab = logits.shape[1]
    index = [i for i, r in enumerate(rows) if r.params.penalised]
    params = [rows[i].params for i in index]
    rows_t = torch.tensor(index)
    out_counts = _counts([rows[i].output_token_ids for i in index], vocab)
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
    chosen = logits.index_select(0, rows_t)
    chosen -= presence * (out_counts > 0) + frequency * out_counts
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (out_counts + _counts([rows[i].prompt_token_ids for i in index], vocab)) > 0
        penalty = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype).unsqueeze(1)
        scaled = torch.where(chosen > 0, chosen / penalty, chosen * penalty)
        chosen = torch.where(seen, scaled, chosen)
    bias_rows = [j for j, p in enumerate(params) for _ in p.logit_bias]
    if bias_rows:
        tokens = [t for p in params for t in p.logit_bias]
        values = torch.tensor([v for p in params for v in p.logit_bias.values()], dtype=logits.dtype)
        chosen.index_put_((torch.tensor(bias_rows), torch.tensor(tokens)), values, accumulate=True)
    logits[rows_t] = chosen
    return logits


def _counts(token_lists: Sequence[Sequence[int]], vocab: int) -> torch.Tensor:
    """[len(token_lists), vocab] occurrence counts, from one flat bincount."""
    flat = [j * vocab + t for j, tokens in enumerate(token_lists) for t in tokens]
    counts = torch.bincount(torch.tensor(flat, dtype=torch.long), minlength=len(token_lists) * vocab)
    return counts.view(len(token_lists), vocab).to(torch.float32)


def _sample_random(logits: torch.Tensor, rows: Sequence[SampleRow], generator: torch.Generator) -> torch.Tensor:
    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype).unsqueeze(1)
    logits = logits / temps
    top_ks = [r.params.top_k for r in rows]
    top_ps = [r.params.top_p for r in rows]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _mask_top_k_top_p(logits, top_ks, top_ps)
    probs = torch.softmax(logits, dim=-1)
    noise = torch.stack([_exponential(logits.shape[1], r, generator) for r in rows])
    # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race).
    return argmax_rows(probs / noise)


def _exponential(vocab: int, row: SampleRow, generator: torch.Generator) -> torch.Tensor:
    gen = generator
    if row.params.seed is not None:
        gen = torch.Generator().manual_seed((row.params.seed * 1_000_003 + row.output_index) % (2**63))
    return torch.empty(vocab).exponential_(generator=gen)


def _mask_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[1]
    ks = torch.tensor([k if k > 0 else vocab for k in top_ks]).clamp(max=vocab)
    ranks = torch.arange(vocab).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
    drop |= before >= torch.tensor(top_ps).unsqueeze(1)
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _logprobs(logits: torch.Tensor, rows: Sequence[SampleRow], tokens: list[int]) -> list[TokenLogprob | None]:
    wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(rows)
    if not wanted:
        return out
    logp = torch.log_softmax(logits.index_select(0, torch.tensor(wanted)), dim=-1)
    for j, i in enumerate(wanted):
        n = rows[i].params.logprobs or 0
        top_v, top_i = logp[j].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.long))
        out[i] = TokenLogprob(tokens[i], float(logp[j, tokens[i]]),
                              list(zip(top_i.tolist(), top_v.tolist())))
    return out
