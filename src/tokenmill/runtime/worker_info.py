"""What a worker registers with discovery (every backend stores the same record)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    address: str  # where its request socket listens (ipc:// or tcp://)
    role: str = "agg"
    model: str = ""
    pid: int = 0
    host: str = ""
    incarnation: str = ""  # changes whenever the worker restarts
    heartbeat_at: float = 0.0  # time.time() of the last heartbeat
    metadata: dict[str, Any] = field(default_factory=dict)
