"""The tiers wired into `LLMEngine`: offload on device eviction, onboard at admission."""
from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.kv_tiers.helpers import RedisServer
from tokenmill.engine.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.textgen.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
BS = 16


def prompts(n: int, length: int = 70, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 200) for _ in range(length)] for _ in range(n)]


def engine(model: Path, blocks: int = 12, **tiers: object) -> LLMEngine:
    cfg = EngineConfig(model=str(model), num_kv_blocks=blocks, block_size=BS, max_num_batched_tokens=256,
                       max_num_seqs=4, **tiers)
    return LLMEngine(cfg, load_tokenizer=False)


def serve_each(eng: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    """One prompt at a time, draining offloads in between so every eviction is stored."""
    outs = []
    for prompt in batch:
        outs.append(eng.generate([prompt], GREEDY)[0])
        if eng.tiers is not None:
            assert eng.tiers.manager.drain()
    return outs


def second_pass(eng: LLMEngine, batch: list[list[int]]) -> tuple[list[list[int]], int, int]:
    """Serve `batch` again; (outputs, prompt tokens computed, tokens onboarded) of that pass."""
    before = eng.stats()
    outs = serve_each(eng, batch)
    after = eng.stats()
    return outs, after.prefill_tokens - before.prefill_tokens, after.onboarded_tokens - before.onboarded_tokens


@pytest.fixture(scope="module")
def reference(tiny_dense: Path) -> dict[str, list[list[int]]]:
    eng = engine(tiny_dense, blocks=64)
    return {"outs": serve_each(eng, prompts(4))}


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_every_prompt_served_from_a_tier_matches_device_only(
        tiny_dense: Path, tmp_path: Path, reference: dict[str, list[list[int]]], tier: str) -> None:
    kwargs = {"kv_host_gb": 0.01} if tier == "host" else {"kv_disk_dir": str(tmp_path / "disk"), "kv_disk_gb": 0.01}
    eng = engine(tiny_dense, **kwargs)  # 12 device blocks: each 70-token prompt evicts the previous
    batch = prompts(4)
    assert serve_each(eng, batch) == reference["outs"]
    if tier == "disk":
        serve_each(eng, batch)  # host absent: straight to disk, no frequency filter
    outs, computed, onboarded = second_pass(eng, batch)
    assert outs == reference["outs"]
    assert onboarded == 4 * 4 * BS  # 4 full blocks per prompt (70 tokens, at least one left to compute)
    assert computed == 4 * (70 - 4 * BS)
    assert eng.stats().tier_stats["tiers"][tier]["hits"] >= 16
    eng.close()


def test_host_to_disk_after_two_uses_and_capacity_bounds(tiny_dense: Path, tmp_path: Path,
                                                          reference: dict[str, list[list[int]]]) -> None:
    block_bytes = 2 * 2 * BS * 2 * 16 * 4  # layers, k/v, block_size, kv_heads, head_dim, float32
    eng = engine(tiny_dense, kv_host_gb=6 * block_bytes / 2**30, kv_disk_dir=str(tmp_path / "d"),
                 kv_disk_gb=40 * block_bytes / 2**30)
    batch = prompts(4)
    for _ in range(3):
        assert serve_each(eng, batch) == reference["outs"]
        tiers = eng.stats().tier_stats["tiers"]
        for name in ("host", "disk"):
            assert tiers[name]["used_bytes"] <= tiers[name]["capacity_bytes"]
    tiers = eng.stats().tier_stats["tiers"]
    assert tiers["disk"]["puts"] > 0 and tiers["host"]["evictions"] > 0
    eng.close()


def test_corrupt_disk_block_is_recomputed(tiny_dense: Path, tmp_path: Path,
                                          reference: dict[str, list[list[int]]]) -> None:
    disk = tmp_path / "disk"
    eng = engine(tiny_dense, kv_disk_dir=str(disk))
    batch = prompts(4)
    serve_each(eng, batch)
    files = sorted(p for p in disk.rglob("*") if p.is_file() and p.stat().st_size > 1000)
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    outs, computed, onboarded = second_pass(eng, batch)
    assert outs == reference["outs"]
    corrupt = eng.stats().tier_stats["tiers"]["disk"]["corrupt"]
    assert corrupt >= 2  # each corrupt block, and the rest of its chain, is computed again
    assert onboarded <= (16 - corrupt) * BS and computed >= 4 * (70 - 4 * BS) + corrupt * BS
    eng.close()


def test_mock_runner_refuses_tiers(tiny_dense: Path) -> None:
    with pytest.raises(ValueError, match="runner"):
        EngineConfig(model=str(tiny_dense), runner="mock", kv_host_gb=1.0)
    with pytest.raises(ValueError, match="kv_write_through needs kv_shared"):
        EngineConfig(model=str(tiny_dense), kv_host_gb=1.0, kv_write_through=True)


def test_pin_file_pins_prefixes(tiny_dense: Path, tmp_path: Path) -> None:
    pin_file = tmp_path / "pins.jsonl"
    prefix = prompts(1, 48)[0]
    pin_file.write_text("# the corpus\n\n" + str(prefix) + "\n")
    eng = engine(tiny_dense, kv_host_gb=0.01, kv_pin_file=str(pin_file))
    assert eng.tiers is not None and len(eng.tiers.manager._pinned) == 3
    assert eng.pin_prefix(prompts(1, 40, seed=9)[0])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        engine(tiny_dense, kv_host_gb=0.01, kv_pin_file=str(bad))
    eng.close()


class TestShared:
    def test_second_engine_serves_first_engines_prefix(
            self, tiny_dense: Path, redis_server: RedisServer, reference: dict[str, list[list[int]]]) -> None:
        batch = prompts(4)
        first = engine(tiny_dense, blocks=64, kv_shared=redis_server.url, kv_write_through=True)
        serve_each(first, batch[:1])  # write-through: stored in Redis as computed, no eviction needed
        second = engine(tiny_dense, blocks=64, kv_shared=redis_server.url)
        outs, computed, onboarded = second_pass(second, batch[:1])
        assert outs == reference["outs"][:1]
        assert onboarded == 4 * BS and computed == 70 - 4 * BS
        pinned = engine(tiny_dense, blocks=64, kv_shared=redis_server.url)  # no write-through: pin stores
        serve_each(pinned, batch[1:2])
        assert pinned.pin_prefix(batch[1]) and pinned.tiers.manager.drain()
        assert second_pass(second, batch[1:2])[2] == 4 * BS
        pinned.close()
        first.close()
        second.close()

    def test_corrupt_redis_block_and_redis_down(
            self, tiny_dense: Path, redis_server: RedisServer, reference: dict[str, list[list[int]]]) -> None:
        import redis

        batch = prompts(4)
        eng = engine(tiny_dense, kv_shared=redis_server.url, kv_write_through=True)
        serve_each(eng, batch)
        client = redis.Redis(port=redis_server.port)
        keys = [k for k in client.keys("*") if client.type(k) == b"string" and (client.strlen(k) or 0) > 1000]
        assert keys
        for key in keys:
            data = bytearray(client.get(key))
            data[len(data) // 2] ^= 0xFF
            client.set(key, bytes(data))
        client.close()
        outs, computed, _ = second_pass(eng, batch)
        assert outs == reference["outs"]
        assert eng.stats().tier_stats["tiers"]["shared"]["corrupt"] > 0
        redis_server.stop()
        outs, computed, onboarded = second_pass(eng, batch)
        assert outs == reference["outs"] and onboarded == 0 and computed == 4 * 70
        eng.close()

    def test_redis_stopped_mid_run_serving_continues(self, tiny_dense: Path, redis_server: RedisServer) -> None:
        early, late = prompts(4, seed=5), prompts(2, seed=6)
        expected = _run_with_arrivals(engine(tiny_dense, blocks=24), early, late, lambda: None)
        eng = engine(tiny_dense, blocks=24, kv_shared=redis_server.url, kv_write_through=True)
        assert _run_with_arrivals(eng, early, late, redis_server.stop) == expected
        assert eng.tiers.manager.drain(timeout_s=60)
        assert eng.stats().tier_stats["tiers"]["shared"]["errors"] > 0  # the late lookups found Redis down
        eng.close()


def _run_with_arrivals(eng: LLMEngine, early: list[list[int]], late: list[list[int]],
                       at_step_2: Callable[[], None]) -> list[list[int]]:
    """`early` from the start, `at_step_2()` then `late` while those are in flight; outputs in order."""
    got: dict[str, list[int]] = {}
    for i, prompt in enumerate(early):
        eng.add_request(f"e{i}", prompt, GREEDY)
        got[f"e{i}"] = []
    for step in range(10_000):
        if step == 2:
            at_step_2()
            for i, prompt in enumerate(late):
                eng.add_request(f"l{i}", prompt, GREEDY)
                got[f"l{i}"] = []
        elif step > 2 and not eng.has_unfinished():
            break
        for out in eng.step():
            got[out.request_id].extend(out.new_token_ids)
    return list(got.values())
