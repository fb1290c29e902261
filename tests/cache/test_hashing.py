"""Chained block hashes: determinism, chaining, unambiguous encoding, incremental extension."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replayserve.cache.hashing import ROOT_HASH, BlockKey, block_keys, hash_block

TOKENS = list(range(100, 140))  # 40 tokens: 10 full blocks of 4, or 2 of 16 plus 8 left over


def test_root_hash_is_a_fixed_32_byte_digest() -> None:
    assert isinstance(ROOT_HASH, bytes) and len(ROOT_HASH) == 32
    assert ROOT_HASH != hashlib.sha256(b"").digest()


def test_hashes_are_deterministic_and_32_bytes() -> None:
    key = BlockKey(ROOT_HASH, (1, 2, 3), ("salt", 7))
    assert hash_block(key) == hash_block(BlockKey(ROOT_HASH, (1, 2, 3), ("salt", 7)))
    assert len(hash_block(key)) == 32
    assert block_keys(TOKENS, 4) == block_keys(list(TOKENS), 4)


def test_block_keys_chain_each_hash_on_its_parent() -> None:
    keys, hashes = block_keys(TOKENS, 4, ("a",))
    assert len(keys) == len(hashes) == 10
    assert keys[0].parent == ROOT_HASH
    for i, (key, h) in enumerate(zip(keys, hashes, strict=True)):
        assert key.tokens == tuple(TOKENS[4 * i : 4 * i + 4])
        assert key.extra_keys == ("a",)
        assert hash_block(key) == h
        if i > 0:
            assert key.parent == hashes[i - 1]
    assert len(set(hashes)) == 10


@pytest.mark.parametrize("block", [0, 3, 9])
def test_changing_a_token_changes_its_block_and_every_later_hash_only(block: int) -> None:
    _, before = block_keys(TOKENS, 4)
    changed = list(TOKENS)
    changed[4 * block + 2] += 1000
    _, after = block_keys(changed, 4)
    assert after[:block] == before[:block]
    for i in range(block, 10):
        assert after[i] != before[i], i


def test_extra_keys_change_every_hash() -> None:
    _, plain = block_keys(TOKENS, 4)
    _, salted = block_keys(TOKENS, 4, ("salt",))
    _, other = block_keys(TOKENS, 4, ("pepper",))
    for a, b, c in zip(plain, salted, other, strict=True):
        assert len({a, b, c}) == 3


def test_same_tokens_under_a_different_parent_hash_differently() -> None:
    other_parent = hashlib.sha256(b"x").digest()
    assert hash_block(BlockKey(ROOT_HASH, (1, 2))) != hash_block(BlockKey(other_parent, (1, 2)))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("ab",), ("a", "b")),
        (("aSb", "c"), ("a", "bSc")),  # only the length prefixes tell these apart
        ((b"aYb", b"c"), (b"a", b"bYc")),
        ((1,), ("1",)),
        ((1,), (True,)),
        (("1",), (True,)),
        ((0,), (False,)),
        ((0,), (None,)),
        ((None,), ()),
        ((b"ab",), ("ab",)),
        ((b"ab",), (b"a", b"b")),
        (((1, 2),), (1, 2)),
        (((1,), 2), (1, (2,))),
        (((),), ()),
        ((256,), (1, 0)),
        ((-1,), (255,)),
        ((2**70,), (2**70 + 1,)),
        (("",), (b"",)),
    ],
)
def test_extra_key_encoding_is_unambiguous(a: tuple, b: tuple) -> None:
    assert hash_block(BlockKey(ROOT_HASH, (5,), a)) != hash_block(BlockKey(ROOT_HASH, (5,), b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ((1,), (0, 1)),
        ((), (0,)),
        ((256,), (1, 0)),
        ((2**32,), (1, 0)),
        ((1, 2), (2, 1)),
    ],
)
def test_token_encoding_is_unambiguous(a: tuple[int, ...], b: tuple[int, ...]) -> None:
    assert hash_block(BlockKey(ROOT_HASH, a)) != hash_block(BlockKey(ROOT_HASH, b))


def test_tokens_and_extra_keys_do_not_run_into_each_other() -> None:
    # An int extra key must not be mistaken for one more token, and vice versa.
    assert hash_block(BlockKey(ROOT_HASH, (1, 2), (3,))) != hash_block(BlockKey(ROOT_HASH, (1, 2, 3)))


_EXTRA_ATOMS = st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=3), st.binary(max_size=3))
_KEY_PARTS = st.tuples(
    st.lists(st.integers(0, 2**63 - 1), max_size=4).map(tuple),
    st.lists(_EXTRA_ATOMS, max_size=3).map(tuple),
)


@given(_KEY_PARTS, _KEY_PARTS)
@settings(max_examples=200, deadline=None)
def test_distinct_keys_hash_distinctly(a: tuple, b: tuple) -> None:
    # Equality of keys is type-aware here (1 == True in Python, but they must hash apart).
    same = a[0] == b[0] and [(type(x), x) for x in a[1]] == [(type(x), x) for x in b[1]]
    ha, hb = hash_block(BlockKey(ROOT_HASH, *a)), hash_block(BlockKey(ROOT_HASH, *b))
    assert (ha == hb) == same


@pytest.mark.parametrize("bad", [1.5, [1], {"a": 1}, {1}, bytearray(b"x"), object()])
def test_bad_extra_key_types_raise_type_error_naming_the_type(bad: object) -> None:
    with pytest.raises(TypeError, match=type(bad).__name__):
        hash_block(BlockKey(ROOT_HASH, (1,), (bad,)))
    with pytest.raises(TypeError, match=type(bad).__name__):
        hash_block(BlockKey(ROOT_HASH, (1,), ("ok", (2, (bad,)))))
    with pytest.raises(TypeError, match=type(bad).__name__):
        block_keys(TOKENS, 4, (bad,))


def test_extra_keys_must_be_a_tuple() -> None:
    with pytest.raises(TypeError, match="list"):
        block_keys(TOKENS, 4, ["salt"])  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 2**63])
def test_token_ids_out_of_range_raise(bad: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        hash_block(BlockKey(ROOT_HASH, (1, bad)))


def test_non_integer_tokens_raise_type_error() -> None:
    with pytest.raises(TypeError):
        hash_block(BlockKey(ROOT_HASH, (1.0,)))  # type: ignore[arg-type]


def test_parent_must_be_32_bytes() -> None:
    with pytest.raises(ValueError, match="32-byte"):
        hash_block(BlockKey(b"short", (1,)))


@pytest.mark.parametrize("num_known", [0, 1, 3, 10])
def test_known_extension_equals_a_fresh_computation(num_known: int) -> None:
    fresh_keys, fresh_hashes = block_keys(TOKENS, 4, ("s",))
    _, short_hashes = block_keys(TOKENS[: 4 * num_known + 2], 4, ("s",))
    assert short_hashes == fresh_hashes[:num_known]
    keys, hashes = block_keys(TOKENS, 4, ("s",), known=short_hashes)
    assert keys == fresh_keys
    assert hashes == fresh_hashes


def test_known_hashes_are_trusted_not_rehashed() -> None:
    # A forged known hash must propagate: proof the known blocks are not recomputed.
    fake = hashlib.sha256(b"fake").digest()
    keys, hashes = block_keys(TOKENS[:8], 4, known=[fake])
    assert hashes[0] == fake
    assert keys[1].parent == fake
    assert hashes[1] == hash_block(BlockKey(fake, tuple(TOKENS[4:8])))


def test_known_longer_than_the_full_blocks_raises() -> None:
    _, hashes = block_keys(TOKENS[:8], 4)
    with pytest.raises(ValueError, match="known"):
        block_keys(TOKENS[:7], 4, known=hashes)


def test_trailing_partial_block_is_left_out() -> None:
    keys, hashes = block_keys(TOKENS, 16)
    assert len(keys) == len(hashes) == 2
    assert block_keys(TOKENS[:32], 16) == (keys, hashes)
    assert block_keys(TOKENS[:15], 16) == ([], [])
    assert block_keys([], 4) == ([], [])


def test_block_size_one_hashes_every_token() -> None:
    keys, hashes = block_keys([7, 7, 7], 1)
    assert [k.tokens for k in keys] == [(7,), (7,), (7,)]
    assert len(set(hashes)) == 3  # same token, different parents


@pytest.mark.parametrize("block_size", [0, -4])
def test_block_size_below_one_raises(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        block_keys(TOKENS, block_size)


def test_known_keys_are_reused_and_the_rest_built() -> None:
    fresh_keys, fresh_hashes = block_keys(TOKENS, 4, ("s",))
    short_keys, short_hashes = block_keys(TOKENS[:12], 4, ("s",))
    keys, hashes = block_keys(TOKENS, 4, ("s",), known=short_hashes, known_keys=short_keys[:2])
    assert (keys, hashes) == (fresh_keys, fresh_hashes)
    assert all(k is s for k, s in zip(keys[:2], short_keys[:2], strict=True))  # reused, not rebuilt


def test_more_known_keys_than_hashes_raises() -> None:
    keys, hashes = block_keys(TOKENS[:8], 4)
    with pytest.raises(ValueError, match="known_keys"):
        block_keys(TOKENS, 4, known=hashes[:1], known_keys=keys)
