"""What an engine reports back per step for one request, and why a stream ended: the frames the
worker sends, the frontend streams and the engine produces alike."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.textgen.sampling import TokenLogprob

# Why a stream ended (the wire protocol's final-frame reasons).
FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR = "stop", "length", "abort", "error"
# A prefill-only request ended after its first token and holds its KV for a decode worker
# (between worker and frontend only: a client never sees it).
FINISH_HANDOFF = "handoff"


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request (a delta, not the whole history)."""
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_reason: str | int | None = None
    text_pending_tokens: int = 0  # trailing tokens whose text is held back (an incomplete character)
    held_block_ids: list[int] = field(default_factory=list)  # FINISH_HANDOFF: the prompt's KV blocks
    # the request's share of the engine's step time since its last output (its tokens' share of
    # each step it was in); 0 where the engine does not measure it (a vLLM worker)
    step_seconds: float = 0.0
