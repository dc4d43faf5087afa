"""What goes into a routing decision and what comes out of it.

`RoutingRequest` is what the frontend knows before routing: the prompt's chained block
hashes (`tokenmill.kv.hashing.block_hashes`, full blocks only) and its length in tokens.
`RoutingDecision` says which worker, why (`reason`, one line fit for a debug log), each
candidate's cost terms (`terms`, empty for policies that do not score), and what the
load tracker was charged for the request (`prefill_charge`, `decode_charge`).
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class RoutingRequest:
    request_id: str
    block_hashes: tuple[int, ...] | list[int]
    prompt_tokens: int

    def prompt_blocks(self, block_size: int) -> int:
        """Blocks the prompt occupies, a trailing partial block included."""
        if self.prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {self.prompt_tokens}")
        if len(self.block_hashes) > self.prompt_tokens // block_size:
            raise ValueError(f"request {self.request_id!r}: {len(self.block_hashes)} block hashes for "
                             f"{self.prompt_tokens} tokens at block size {block_size}")
        return -(-self.prompt_tokens // block_size)


@dataclass(slots=True)
class WorkerTerms:
    """One candidate's side of the cost function (see `tokenmill.router.cost`)."""
    worker: str
    overlap: dict[str, int]     # tier -> leading prompt blocks the worker holds there
    cached_blocks: float        # Σ_tier w_tier · overlap_tier
    new_prefill: float          # max(0, prompt_blocks − cached_blocks)
    active_prefill: float       # the worker's prefill backlog, in blocks
    request_decode: float       # blocks the request newly takes on the worker's device
    active_decode: float        # blocks the worker's running sequences hold
    cost: float
    shortfall: float = 0.0      # device blocks the request would lack room for there

    @property
    def prefill(self) -> float:
        return self.new_prefill + self.active_prefill

    @property
    def decode(self) -> float:
        return self.active_decode + self.request_decode

    def describe(self) -> str:
        return (f"{self.worker}: cost {self.cost:g} = prefill {self.prefill:g} "
                f"(new {self.new_prefill:g} + active {self.active_prefill:g}) "
                f"+ decode {self.decode:g} (active {self.active_decode:g} + request {self.request_decode:g})"
                + (f" + {self.shortfall:g} blocks short of room" if self.shortfall else ""))


@dataclass(slots=True)
class RoutingDecision:
    request_id: str
    worker: str
    policy: str
    reason: str
    prompt_blocks: int
    overlap_blocks: int = 0          # leading blocks the chosen worker already holds (any tier)
    prefill_charge: float = 0.0      # charged to the worker's active prefill until first token
    decode_charge: float = 0.0       # charged to its active decode blocks until the request ends
    probability: float | None = None  # with temperature > 0: the chosen worker's probability
    terms: list[WorkerTerms] = field(default_factory=list)

    def explain(self) -> str:
        """Multi-line: the reason, then every candidate's terms, cheapest first."""
        lines = [f"{self.request_id} -> {self.worker} [{self.policy}]: {self.reason}"]
        lines += ["  " + t.describe() for t in sorted(self.terms, key=lambda t: t.cost)]
        return "\n".join(lines)
