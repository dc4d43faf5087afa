"""tokenmill.router: KV-aware routing. Must not import engine or worker.

Modules: `indexer` (global KV index from KV events, gaps and snapshots), `approx`
(index for engines without events), `load` (active prefill/decode blocks per worker),
`cost` (overlap vs load, the decision's terms), `disagg` (where a prompt is prefilled), `policies` (the `Router` facade and the
`--router` policies), `stats` (metrics, events-stale alarm), `prefix_walk` (the hot loop).
Start from `policies.Router`; its module docstring shows the whole call sequence.
"""
from tokenmill.router.cost import CostConfig
from tokenmill.router.decision import RoutingDecision, RoutingRequest, WorkerTerms
from tokenmill.router.indexer import ApplyStatus, KVIndexer
from tokenmill.router.policies import POLICIES, NoWorkerAvailable, Router, RouterConfig

__all__ = ["POLICIES", "ApplyStatus", "CostConfig", "KVIndexer", "NoWorkerAvailable", "Router", "RouterConfig",
           "RoutingDecision", "RoutingRequest", "WorkerTerms"]
