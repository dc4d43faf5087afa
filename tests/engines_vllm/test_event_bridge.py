"""vLLM's KV events re-hashed into tokenmill's chain: stored blocks get the hashes `kv.hashing`
gives the same tokens (continuing a parent stored earlier, in any tier), removals carrying only
vLLM's hashes remove the right tokenmill hashes, and the view answers snapshots. The events are
stand-ins with vLLM's class names and fields (vLLM itself runs only in its own venv)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engines.vllm.events import VLLMEventBridge
from tokenmill.kv.events import AllCleared, BlockRemoved, BlockStored, KVEvent, KVEventEmitter
from tokenmill.kv.hashing import block_hashes

B = 4


@dataclass
class BlockStoredEvent:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int = B
    medium: str | None = "GPU"
    extra_keys: list[Any] | None = None


@dataclass
class BlockRemovedEvent:
    block_hashes: list[Any]
    medium: str | None = "GPU"


@dataclass
class AllBlocksClearedEvent:
    pass


# the bridge reads vLLM's class names
BlockStoredEvent.__name__ = "BlockStored"
BlockRemovedEvent.__name__ = "BlockRemoved"
AllBlocksClearedEvent.__name__ = "AllBlocksCleared"


@dataclass
class Recorder:
    events: list[KVEvent] = field(default_factory=list)

    def bridge(self) -> VLLMEventBridge:
        emitter = KVEventEmitter("w0")
        emitter.subscribe(self.events.append)
        return VLLMEventBridge(emitter, B)


def test_a_chain_stored_in_two_events_hashes_as_one_prompt() -> None:
    rec = Recorder()
    bridge = rec.bridge()
    tokens = list(range(10, 22))  # three blocks of four
    bridge.apply([BlockStoredEvent([b"v1"], None, tokens[:4]),
                  BlockStoredEvent([b"v2", b"v3"], b"v1", tokens[4:12])])
    expected = block_hashes(tokens, B)
    assert [e.hashes for e in rec.events] == [tuple(expected[:1]), tuple(expected[1:])]
    assert [e.parent for e in rec.events] == [None, expected[0]]
    assert [e.event_id for e in rec.events] == [0, 1]
    assert sorted(bridge.view()["device"]) == sorted(expected)


def test_removals_map_back_to_tokenmill_hashes_and_clear_empties_the_view() -> None:
    rec = Recorder()
    bridge = rec.bridge()
    tokens = list(range(8))
    expected = block_hashes(tokens, B)
    bridge.apply([BlockStoredEvent([7, 8], None, tokens), BlockRemovedEvent([8, 99])])
    removed = rec.events[-1]
    assert isinstance(removed, BlockRemoved) and removed.hashes == (expected[1],)  # 99: never stored
    assert bridge.view() == {"device": [expected[0]]}
    bridge.apply([AllBlocksClearedEvent()])
    assert isinstance(rec.events[-1], AllCleared) and bridge.view() == {}


def test_media_are_tiers_a_salt_seeds_block_zero_and_an_unknown_parent_is_not_guessed() -> None:
    rec = Recorder()
    bridge = rec.bridge()
    tokens = list(range(30, 38))
    bridge.apply([BlockStoredEvent([1], None, tokens[:4], medium="CPU", extra_keys=[("salt-a",)])])
    first = block_hashes(tokens[:4], B, extra_key="salt-a")
    assert rec.events[-1] == BlockStored("w0", "host", None, tuple(first), 0)
    assert first != block_hashes(tokens[:4], B)
    bridge.apply([BlockStoredEvent([2], 1, tokens[4:])])  # a device block continuing a host one
    assert rec.events[-1].hashes == tuple(block_hashes(tokens, B, extra_key="salt-a")[1:])
    bridge.apply([BlockStoredEvent([3], 12345, tokens[:4])])
    assert len(rec.events) == 2 and bridge.unchained == 1
