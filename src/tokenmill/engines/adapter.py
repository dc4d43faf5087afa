"""What a worker needs from an engine, and nothing more.

    engine = make_engine(...)                      # an EngineAdapter
    await engine.start()                           # loads the model; raises EngineStartError
    info = engine.info                             # limits the worker registers and enforces
    async for out in engine.generate(rid, prompt_ids, params):   # RequestOutput deltas
        ...                                        # cancelling the iteration aborts the request
    stats = await engine.stats()                   # the load a heartbeat carries
    engine.events.subscribe(fn)                    # tokenmill KV events (kv.events), in order
    last_id, tiers = await engine.kv_snapshot()    # what is cached now, as of event last_id

Contract (every adapter):
- `generate` takes prompt *token ids* (the frontend tokenizes, so the router's block hashes are the
  tokens the engine caches) and tokenmill's `SamplingParams`; it raises ValueError before the first
  delta for a request the engine refuses. Text deltas follow `engine.output_processor`'s rules
  (stop strings cut, characters held back while a stop string may start), and a migrated request's
  `output_offset`/`text_pending` continue its text where the dead worker left it.
- A consumer that stops iterating (client gone, task cancelled) aborts the request in the engine,
  which frees its KV blocks.
- `events` publishes `stored/removed/cleared` with tokenmill's chained block hashes (`kv.hashing`),
  numbered by one `KVEventEmitter`; `kv_snapshot` is consistent with the last event id it names.
- `stats` fills `EngineStats` (running, waiting, KV use, free blocks, prefix hit rate, tokens), so
  an outside engine's worker exports the same load and Prometheus families as the own engine's.
- Features an engine lacks (`pin_prefix`, tiers toggled at run time, KV handoff) are refused with
  ValueError / False, never silently ignored.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from tokenmill.kv.events import KVEventEmitter
from tokenmill.textgen.outputs import RequestOutput
from tokenmill.textgen.sampling import SamplingParams

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import KVImport
    from tokenmill.engine.stats import EngineStats


class EngineStartError(RuntimeError):
    """The engine could not start (bad option, model it cannot load, no memory): the reason is the
    engine's own; the worker exits non-zero with it, and its supervisor retries."""


@dataclass(slots=True, frozen=True)
class EngineInfo:
    """The limits a worker registers (the frontend checks prompts against them) and enforces."""
    name: str  # ENGINES
    max_model_len: int
    block_size: int  # must equal the routers' block size: their hashes are of blocks this long
    hash_seed: int
    max_num_seqs: int
    deterministic: bool = False  # batch-invariant kernels (the own engine's --deterministic)


class EngineAdapter(Protocol):
    @property
    def info(self) -> EngineInfo: ...

    @property
    def events(self) -> KVEventEmitter: ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def is_running(self) -> bool: ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 extra_key: str | None = None, output_offset: int = 0, text_pending: int = 0, *,
                 prefill_only: bool = False, kv_import: KVImport | None = None) -> AsyncIterator[RequestOutput]: ...

    async def stats(self) -> EngineStats: ...

    def idle_stats(self) -> EngineStats:
        """The stats before serving (no request yet), read without awaiting the engine."""
        ...

    async def kv_snapshot(self) -> tuple[int, dict[str, list[int]]]:
        """(the last event id it reflects, tier -> every block hash held there)."""
        ...

    async def set_tiers_enabled(self, enabled: bool) -> bool: ...

    async def pin_prefix(self, token_ids: list[int]) -> bool: ...

    async def call(self, fn: Any) -> Any:
        """Run `fn` against the engine's own object between steps (admin, inspection)."""
        ...
