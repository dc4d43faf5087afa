"""One client request's progress across the workers that serve it: the state that the backend's
migration loop (`distributed_backend.py`) and remote prefill (`prefill.py`) advance, and the only
place either changes it.

Its life, as the two drive it:

    fresh ──remote prefill──▶ first token, `kv_handle` held ──decode attempt──▶ tokens ... finished
      │                                    (`take_handle`: one attempt uses it)       ▲
      └──────────────── decode attempt (the decode worker prefills) ─────────────────┤
                         a worker lost mid-stream: `migrated`, the next attempt
                         resumes from `tokens` (prompt + generated) ─────────────────┘

`account` restates each attempt's output relative to the client's request (counts over every
attempt, the first attempt's cache hit); `end` finishes it with a reason and no tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import SamplingParams


@dataclass(slots=True)
class RequestProgress:
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None  # the first attempt's prefix hit: what the client is told
    text_pending: int = 0  # trailing generated tokens whose text the client has not received
    migrations: int = 0
    finished: bool = False
    cached_tokens_at_decode: int = 0  # the chosen decode worker's prefix hit, per its router
    kv_handle: dict[str, Any] | None = None  # from a remote prefill, for the next decode attempt
    follow: str | None = None  # a request whose worker this one should share (the same prompt)

    @property
    def fresh(self) -> bool:
        """Nothing generated and never migrated: only such a request may be prefilled remotely."""
        return not self.generated and not self.migrations

    @property
    def tokens(self) -> list[int]:
        """What the next attempt is sent: the prompt and every token the client already has."""
        return self.prompt + self.generated

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_tokens - len(self.generated)

    def routed(self, cached_tokens: int) -> None:
        """A decode worker was chosen that caches this many of the tokens, by its router's index."""
        self.cached_tokens_at_decode = cached_tokens

    def hold_handle(self, handle: dict[str, Any]) -> None:
        self.kv_handle = handle

    def take_handle(self) -> dict[str, Any] | None:
        """The remote prefill's KV handle, for one decode attempt only (a retry recomputes)."""
        handle, self.kv_handle = self.kv_handle, None
        return handle

    def migrated(self) -> None:
        self.migrations += 1

    def account(self, out: RequestOutput) -> RequestOutput:
        """`out` restated relative to the client's request, not to this attempt (`out` is the
        caller's to give up: it was just decoded from the wire)."""
        if self.num_cached_tokens is None:
            self.num_cached_tokens = out.num_cached_tokens
        self.generated.extend(out.new_token_ids)
        self.text_pending = out.text_pending_tokens
        self.finished = out.finished
        out.num_prompt_tokens = len(self.prompt)
        out.num_output_tokens = len(self.generated)
        out.num_cached_tokens = self.num_cached_tokens
        return out

    def end(self, request_id: str, reason: str) -> RequestOutput:
        """Finish the request with `reason` (abort, error) and no more tokens."""
        self.finished = True
        return RequestOutput(request_id, [], "", True, reason, len(self.prompt), len(self.generated),
                             self.num_cached_tokens or 0)
