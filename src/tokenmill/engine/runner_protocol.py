"""What the engine needs from a model runner, torch-free.

`TorchModelRunner` (`engine/runner.py`) runs the real forward pass; `MockRunner` prices the
step with a clock. The engine talks to either through `ModelRunner`, so a mock worker never
imports torch.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.textgen.sampling import TokenLogprob

if TYPE_CHECKING:
    from tokenmill.engine.scheduler import SchedulerOutput
    from tokenmill.kv.cache_manager import KVCacheManager

# request id -> (token, logprob) per sampled row: one, or one per verified draft plus one
Sampled = dict[str, list[tuple[int, TokenLogprob | None]]]
# (shape, torch dtype) -> zero-filled tensor: lets a worker put the KV pool in shared memory
KVAllocator = Callable[[tuple[int, ...], Any], Any]


class ModelRunner(Protocol):
    def execute(self, out: SchedulerOutput, kv: KVCacheManager) -> Sampled:
        """Compute the step; return the tokens of every request whose step reached its end: one,
        or with drafts the target's token at each of the draft rows and after them."""
        ...

    def close(self) -> None:
        """Release what the runner holds beyond memory (a parallel runner's other ranks)."""
        ...

    def step_seconds(self, measured: float) -> float:
        """How long the step it just executed takes on the device it stands for (its busy time,
        shared among the step's requests), given the host's `measured` time."""
        ...
