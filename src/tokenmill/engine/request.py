"""A request's state inside the engine (what it reports back per step is `textgen.outputs`)."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.textgen.sampling import SamplingParams, TokenLogprob


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)  # an entity: compared by identity, never field by field
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    extra_key: str | None = None  # namespace for prefix caching (LoRA, cache salt)
    output_offset: int = 0  # tokens generated elsewhere before this (a migrated request's seed stream)
    text_pending: int = 0  # of those, the trailing ones whose text the client has not seen yet
    arrival_time: float = field(default_factory=time.monotonic)
    token_ids: list[int] = field(default_factory=list)  # prompt + output, grows by one per step
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in this worker's cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    admitted: bool = False
    prefill_only: bool = False  # stop after the first token and hold the KV (disaggregated prefill)
    dp_rank: int = 0  # the attention data-parallel rank whose scheduler and KV pool hold it
    matcher: Any = None  # the grammar's matcher (llguidance) while a structured output is generated
    # speculative tokens after `token_ids`, proposed for the next step and not verified yet: they
    # never enter `token_ids`, the prefix cache or the outputs until the target model confirms them
    draft_token_ids: list[int] = field(default_factory=list)
    draft_limit: int | None = None  # drafts to propose next (speculative.Drafter); None: the configured K
    draft_misses: int = 0  # verify steps in a row that accepted none of its draft model's drafts
    draft_pause: int = 0  # steps left before it drafts again (speculative.pause_after)
    step_seconds: float = 0.0  # its share of the steps it was in, not yet reported (`take_step_seconds`)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def all_output_token_ids(self) -> list[int]:
        """Every token generated for this request, those generated elsewhere before it came here (a
        migrated or imported request's, the tail of its prompt) included: what penalties count."""
        if not self.output_offset:
            return self.output_token_ids
        return self.prompt_token_ids[len(self.prompt_token_ids) - self.output_offset:] + self.output_token_ids

    def tokens_at(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end), drafts past the known tokens included."""
        if end <= len(self.token_ids):
            return self.token_ids[start:end]
        return (self.token_ids + self.draft_token_ids)[start:end]

    def append_token(self, token_id: int, logprob: TokenLogprob | None) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def take_step_seconds(self) -> float:
        """Its share of the steps since the last call (what its next output reports)."""
        seconds, self.step_seconds = self.step_seconds, 0.0
        return seconds
