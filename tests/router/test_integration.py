"""In-process integration: four real KV caches (`BlockPool` + `KVCacheManager`, no engine)
publishing real KV events into the router, under a shared-prefix workload.

16 groups × 8 prompts; a group's prompts share a 512-token prefix (32 blocks of 16) and add a
unique 135-token suffix. Prompts arrive group-interleaved (each round one prompt of every group,
in a shuffled order); each is "prefilled" on its worker at once (its blocks enter the prefix
cache and are announced), then decodes while the next 15 arrive (a window of 16 requests).
Achievable prefix hits: every prompt after the first of its group could reuse its group's
32 prefix blocks, 16 × 7 × 32 = 3,584 blocks; realised: the prefix blocks each prompt really
found in its worker's cache.
"""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass

from tokenmill.kv.block_pool import BlockPool
from tokenmill.kv.cache_manager import KVCacheManager
from tokenmill.kv.events import KVEvent, KVEventEmitter
from tokenmill.kv.hashing import block_hashes
from tokenmill.router.decision import RoutingRequest
from tokenmill.router.indexer import ApplyStatus
from tokenmill.router.policies import Router, RouterConfig

BLOCK_SIZE = 16
GROUPS, PROMPTS_PER_GROUP = 16, 8
PREFIX_TOKENS, SUFFIX_TOKENS = 512, 135
PREFIX_BLOCKS = PREFIX_TOKENS // BLOCK_SIZE
WINDOW = 16
POOL_BLOCKS = 320  # small enough that old suffixes are evicted (removed events flow too)
ACHIEVABLE = GROUPS * (PROMPTS_PER_GROUP - 1) * PREFIX_BLOCKS


@dataclass(slots=True)
class RunResult:
    realised_prefix_blocks: int
    mean_active_blocks: dict[str, float]
    removed_events: int


def workload(seed: int) -> list[tuple[int, list[int]]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(32_000) for _ in range(PREFIX_TOKENS)] for _ in range(GROUPS)]
    prompts: list[tuple[int, list[int]]] = []
    for _ in range(PROMPTS_PER_GROUP):
        order = list(range(GROUPS))
        rng.shuffle(order)
        prompts += [(g, prefixes[g] + [rng.randrange(32_000) for _ in range(SUFFIX_TOKENS)]) for g in order]
    return prompts


def run(policy: str, seed: int = 0) -> RunResult:
    router = Router(RouterConfig(policy=policy, block_size=BLOCK_SIZE), rng=random.Random(seed))
    caches: dict[str, KVCacheManager] = {}
    removed = 0

    def deliver(event: KVEvent) -> None:
        nonlocal removed
        removed += event.kind == "removed"
        assert router.apply_event(event) in (ApplyStatus.APPLIED, ApplyStatus.IGNORED)

    for name in ("w0", "w1", "w2", "w3"):
        emitter = KVEventEmitter(name)
        emitter.subscribe(deliver)
        caches[name] = KVCacheManager(BlockPool(POOL_BLOCKS, BLOCK_SIZE, events=emitter))
        router.add_worker(name)
    active: deque[tuple[str, str]] = deque()
    fresh_blocks: dict[str, int] = {}  # request -> blocks it allocated beyond its prefix hits
    realised, active_sums = 0, dict.fromkeys(caches, 0.0)
    for step, (_, tokens) in enumerate(workload(seed)):
        request_id = f"r{step}"
        decision = router.select(RoutingRequest(request_id, block_hashes(tokens, BLOCK_SIZE), len(tokens)))
        cache = caches[decision.worker]
        hit = cache.find_cached_prefix(request_id, tokens)
        assert cache.allocate(request_id, len(tokens), hit)
        cache.cache_computed(request_id, tokens, len(tokens))  # prefill done: blocks announced
        router.on_progress(request_id, len(tokens), len(hit.blocks) * BLOCK_SIZE)  # as the frontend does
        realised += min(len(hit.blocks), PREFIX_BLOCKS)
        fresh_blocks[request_id] = len(cache.block_ids(request_id)) - len(hit.blocks)
        active.append((request_id, decision.worker))
        if len(active) > WINDOW:
            done_id, done_worker = active.popleft()
            caches[done_worker].free(done_id)
            router.on_finished(done_id)
        for name, cache in caches.items():
            active_sums[name] += cache.pool.num_blocks - cache.pool.num_free_blocks
            # the router's books match the workers' own figures (see tokenmill.router.load)
            assert router.load.load(name).decode_blocks == sum(fresh_blocks[r] for r, w in active if w == name)
    steps = GROUPS * PROMPTS_PER_GROUP
    return RunResult(realised, {w: s / steps for w, s in active_sums.items()}, removed)


def test_kv_routing_realises_the_achievable_prefix_hits_with_balanced_load() -> None:
    kv = run("kv")
    assert kv.removed_events > 0                     # eviction events reached the index too
    assert kv.realised_prefix_blocks >= 0.9 * ACHIEVABLE
    loads = kv.mean_active_blocks.values()
    assert max(loads) <= 1.5 * min(loads)


def test_round_robin_realises_far_fewer() -> None:
    kv, round_robin = run("kv"), run("round-robin")
    assert round_robin.realised_prefix_blocks <= 0.6 * kv.realised_prefix_blocks
