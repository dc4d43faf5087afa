"""A request's progress across workers, shared by the backend's migration loop
(`distributed_backend.py`) and remote prefill (`prefill.py`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.textgen.sampling import SamplingParams


@dataclass(slots=True)
class RequestProgress:
    """One client request's state across its attempts: what the client has received so far, the
    migrations made, and what a remote prefill handed on (its KV handle). The backend's migration
    loop and the remote prefill both read and advance it."""
    prompt: list[int]
    params: SamplingParams
    generated: list[int] = field(default_factory=list)
    num_cached_tokens: int | None = None
    text_pending: int = 0  # trailing generated tokens whose text the client has not received
    migrations: int = 0
    finished: bool = False
    cached_tokens_at_decode: int = 0  # the chosen decode worker's prefix hit, per its router
    kv_handle: dict[str, Any] | None = None  # from a remote prefill, for the next decode attempt
    follow: str | None = None  # a request whose worker this one should share (the same prompt)
