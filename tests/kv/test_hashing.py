import struct

import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tokenmill.kv.hashing import block_hashes, hash_block


def _reference(tokens: list[int], bs: int, seed: int) -> list[int]:
    """The ARCHITECTURE.md definition ("Block hashing"), written out independently of the implementation."""
    out: list[int] = []
    for i in range(len(tokens) // bs):
        raw = b"".join(struct.pack("<I", t) for t in tokens[i * bs:(i + 1) * bs])
        local = xxhash.xxh3_64_intdigest(raw, seed=seed)
        out.append(local if i == 0 else xxhash.xxh3_64_intdigest(
            struct.pack("<Q", out[-1]) + struct.pack("<Q", local), seed=seed))
    return out


@given(st.lists(st.integers(0, 2**32 - 1), max_size=80), st.integers(1, 8), st.integers(0, 2**32))
def test_matches_the_design_definition(tokens: list[int], bs: int, seed: int) -> None:
    assert block_hashes(tokens, bs, seed) == _reference(tokens, bs, seed)


def test_trailing_partial_block_is_not_hashed() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2
    assert block_hashes(list(range(47)), 16) == block_hashes(list(range(32)), 16)


def test_chain_depends_on_every_earlier_block() -> None:
    a, b = list(range(48)), list(range(48))
    b[3] = 999
    ha, hb = block_hashes(a), block_hashes(b)
    assert all(x != y for x, y in zip(ha, hb))


def test_extra_key_separates_namespaces_and_continuation_matches() -> None:
    toks = list(range(64))
    plain, salted = block_hashes(toks), block_hashes(toks, extra_key="lora-a")
    assert not set(plain) & set(salted)
    assert block_hashes(toks, extra_key="lora-a") == salted
    head = block_hashes(toks[:32], extra_key="lora-a")
    assert head + block_hashes(toks[32:], parent=head[-1]) == salted
    assert hash_block(None, toks[:16], extra_key="lora-a") == salted[0]
