"""The engines a worker can host, behind one seam (`engines.adapter.EngineAdapter`).

    tokenmill worker --model M                      # tokenmill's own engine (the embedded default)
    tokenmill worker --model M --engine vllm \\
        --engine-arg dtype=float32 -- --enforce-eager  # vLLM's AsyncLLM in this process

The worker's request plane, KV-event publisher, heartbeats and admin frames speak only to the
adapter, so the frontend, router, planner and dashboard never know which engine serves. A second
outside engine (SGLang) is one more subpackage here that provides the same adapter.
"""
from __future__ import annotations

OWN, VLLM = "tokenmill", "vllm"
ENGINES: tuple[str, ...] = (OWN, VLLM)
