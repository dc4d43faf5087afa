"""Engine results in OpenAI terms: finish reasons, usage, and both logprob formats.

Finish reasons: the engine's "stop" and "length" pass through. "abort" (the request
hit its server-side deadline) is reported as "length": the output is real but was
cut short by a limit, which is what "length" tells OpenAI clients; the outcome is
also counted as `tokenmill_requests_total{status="deadline"}`. "error" never becomes
a finish reason: it is an error object (an SSE error event, or a 5xx).
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence

from tokenmill.api.schema import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptTokensDetails,
    TopLogprob,
    Usage,
)
from tokenmill.textgen.outputs import FINISH_ABORT, FINISH_LENGTH, RequestOutput
from tokenmill.textgen.sampling import TokenLogprob
from tokenmill.textgen.tokenizer import Tokenizer


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def api_finish_reason(engine_reason: str | None) -> str | None:
    if engine_reason == FINISH_ABORT:
        return FINISH_LENGTH
    return engine_reason


def usage_of(last: RequestOutput) -> Usage:
    return Usage(prompt_tokens=last.num_prompt_tokens, completion_tokens=last.num_output_tokens,
                 total_tokens=last.num_prompt_tokens + last.num_output_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=last.num_cached_tokens))


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False)


class CompletionLogprobsWriter:
    """Legacy completions logprobs; `text_offset` counts characters from the start of the completion."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.offset = 0

    def add(self, logprobs: Sequence[TokenLogprob]) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for lp in logprobs:
            text = token_text(self.tokenizer, lp.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({token_text(self.tokenizer, tid): value for tid, value in lp.top})
            out.text_offset.append(self.offset)
            self.offset += len(text)
        return out


def chat_logprobs(tokenizer: Tokenizer, logprobs: Sequence[TokenLogprob]) -> ChatChoiceLogprobs:
    """`bytes` are each token's own bytes: a token holding part of a character decodes to U+FFFD,
    but its bytes joined with its neighbours' give the character back."""
    content = []
    for lp in logprobs:
        top = [TopLogprob(token=token_text(tokenizer, tid), logprob=value, bytes=list(tokenizer.token_bytes(tid)))
               for tid, value in lp.top]
        content.append(ChatTokenLogprob(token=token_text(tokenizer, lp.token_id), logprob=lp.logprob,
                                        bytes=list(tokenizer.token_bytes(lp.token_id)), top_logprobs=top))
    return ChatChoiceLogprobs(content=content)
