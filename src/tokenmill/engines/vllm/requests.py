"""tokenmill's requests in vLLM's terms and back: sampling parameters one to one, outputs as
`RequestOutput` deltas.

vLLM samples, checks stop token ids, EOS and max_tokens, and enforces grammars; tokenmill's own
`OutputProcessor` turns token ids into text, so stop strings, held-back characters and a migrated
request's pending text behave exactly as on an own-engine worker (vLLM runs with
`detokenize=False`: stop strings are matched here, and a match aborts the request in vLLM).
"""
from __future__ import annotations

import json
from typing import Any

from vllm import SamplingParams as VLLMSamplingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from tokenmill.textgen.sampling import SamplingParams, TokenLogprob

FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT, "error": FINISH_ERROR}


def vllm_params(params: SamplingParams) -> VLLMSamplingParams:
    """The same request for vLLM (tokenmill's top_k 0 and -1 both disable, as vLLM's 0 does)."""
    return VLLMSamplingParams(
        max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        top_k=max(0, params.top_k), seed=params.seed, stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos, logprobs=params.logprobs,
        presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty, logit_bias=dict(params.logit_bias) or None,
        structured_outputs=StructuredOutputsParams(grammar=lark_of(params.grammar)) if params.grammar else None,
        detokenize=False, skip_special_tokens=False, output_kind=RequestOutputKind.DELTA)


def lark_of(grammar: str) -> str:
    """tokenmill's grammar as the Lark text vLLM's `grammar` option takes: Lark rules stay as they are;
    llguidance's JSON form (one grammar: Lark or a JSON schema) is unwrapped, a schema becoming
    llguidance's `%json` rule."""
    try:
        top = json.loads(grammar)
    except ValueError:
        return grammar  # Lark text already
    try:
        [only] = top["grammars"]
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError("response_format: the grammar is not one llguidance grammar") from exc
    if only.get("lark_grammar"):
        return str(only["lark_grammar"])
    if only.get("json_schema") is not None:
        return "start: %json " + json.dumps(only["json_schema"])
    raise ValueError("response_format: the grammar has neither Lark rules nor a JSON schema")


def vllm_prompt(prompt_token_ids: list[int], extra_key: str | None) -> dict[str, Any]:
    """A tokens prompt; the extra key (a cache namespace) is vLLM's cache salt, which vLLM folds into
    its first block's hash as tokenmill folds it into its block 0 seed."""
    prompt: dict[str, Any] = {"prompt_token_ids": list(prompt_token_ids)}
    if extra_key is not None:
        prompt["cache_salt"] = extra_key
    return prompt


def token_logprobs(token_ids: list[int], logprobs: list[dict[int, Any]] | None, top_n: int | None) -> list[TokenLogprob]:
    """vLLM's per-position {token id: Logprob(logprob, rank)} as tokenmill's: the sampled token's
    logprob and the top `top_n` (best first)."""
    if top_n is None or not logprobs:
        return []
    out = []
    for token, entries in zip(token_ids, logprobs):
        ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank is not None
                         and lp.rank <= top_n), key=lambda row: row[0])
        sampled = entries.get(token)
        out.append(TokenLogprob(token, float(sampled.logprob) if sampled is not None else float("-inf"),
                                [(tid, float(lp)) for _, tid, lp in ranked]))
    return out


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return FINISH_REASONS.get(reason, FINISH_ERROR)
