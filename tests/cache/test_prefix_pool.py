"""PrefixBlockPool: reference counts, LRU eviction of free cached ids, publish / lookup rules."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from replayserve.cache.block_pool import PoolExhausted
from replayserve.cache.hashing import ROOT_HASH, BlockHash, BlockKey, hash_block
from replayserve.cache.prefix_pool import PrefixBlockPool


def _key(*tokens: int) -> tuple[BlockHash, BlockKey]:
    key = BlockKey(ROOT_HASH, tokens)
    return hash_block(key), key


def _state(pool: PrefixBlockPool) -> tuple:
    """Everything about the pool, free-queue order included, to show a failed call changed nothing."""
    ids = range(pool._offset, pool._offset + pool.size)
    return pool.num_cached, [pool.ref_count(i) for i in ids], [pool.hash_of(i) for i in ids], list(pool._free)


def test_new_pool_is_all_free_unhashed_and_ascending_from_the_offset() -> None:
    pool = PrefixBlockPool(4, "kv", id_offset=10)
    assert (pool.name, pool.size, pool.num_free, pool.num_cached) == ("kv", 4, 4, 0)
    assert all(pool.ref_count(i) == 0 and pool.hash_of(i) is None for i in range(10, 14))
    assert pool.allocate(0) == []
    assert pool.allocate(4) == [10, 11, 12, 13]
    assert pool.num_free == 0 and all(pool.ref_count(i) == 1 for i in range(10, 14))
    pool.check()


@pytest.mark.parametrize("bad", [9, 14, 0])
def test_foreign_ids_raise_value_error(bad: int) -> None:
    pool = PrefixBlockPool(4, "kv", id_offset=10)
    h, key = _key(1)
    calls = [lambda: pool.acquire([bad]), lambda: pool.release([bad]), lambda: pool.publish(bad, h, key)]
    for call in [*calls, lambda: pool.ref_count(bad), lambda: pool.hash_of(bad)]:
        with pytest.raises(ValueError, match="not in this pool"):
            call()


def test_exhausted_pool_raises_and_changes_nothing() -> None:
    pool = PrefixBlockPool(3, "mamba slots")
    pool.allocate(2)
    before = _state(pool)
    with pytest.raises(PoolExhausted, match=r"mamba slots.*2.*1 free of 3"):
        pool.allocate(2)
    assert _state(pool) == before


def test_tail_of_a_sequence_released_in_reverse_is_evicted_first() -> None:
    pool = PrefixBlockPool(6, "kv")
    seq, other = pool.allocate(3), pool.allocate(3)
    pool.release(other)
    pool.release(seq[::-1])
    assert pool.allocate(6) == [3, 4, 5, 2, 1, 0]  # the sequence's head (0) goes last


def test_freed_cached_id_stays_findable_until_evicted() -> None:
    pool = PrefixBlockPool(2, "kv")
    h, key = _key(1, 2)
    (a,) = pool.allocate(1)
    assert pool.publish(a, h, key)
    pool.release([a])
    assert (pool.lookup(h, key), pool.num_cached, pool.num_free, pool.hash_of(a)) == (a, 1, 2, h)
    assert pool.allocate(1) == [1]  # the never-used id is at the head: no eviction yet
    assert pool.lookup(h, key) == a
    assert pool.allocate(1) == [a]  # eviction: unpublished, back with count 1 and no hash
    assert (pool.lookup(h, key), pool.num_cached, pool.hash_of(a), pool.ref_count(a)) == (None, 0, None, 1)
    pool.check()


def test_lookup_changes_neither_counts_nor_lru_order() -> None:
    pool = PrefixBlockPool(3, "kv")
    h, key = _key(9)
    ids = pool.allocate(3)
    pool.publish(ids[0], h, key)
    pool.release(ids)
    assert [pool.lookup(h, key) for _ in range(3)] == [ids[0]] * 3
    assert pool.ref_count(ids[0]) == 0
    assert pool.allocate(1) == [ids[0]]  # still at the head: lookup did not refresh it


def test_acquire_of_a_free_cached_id_removes_it_from_the_free_queue() -> None:
    pool = PrefixBlockPool(3, "kv")
    h, key = _key(1)
    ids = pool.allocate(3)
    pool.publish(ids[1], h, key)
    pool.release(ids)
    pool.acquire([ids[1]])
    assert (pool.num_free, pool.ref_count(ids[1]), pool.hash_of(ids[1])) == (2, 1, h)
    pool.check()
    assert pool.allocate(2) == [ids[0], ids[2]]  # the acquired id is skipped
    with pytest.raises(PoolExhausted):
        pool.allocate(1)
    assert pool.lookup(h, key) == ids[1]  # in use, so never evicted


def test_acquire_and_release_count_duplicates_within_one_call() -> None:
    pool = PrefixBlockPool(2, "kv")
    pool.acquire([1, 1])  # a free, unhashed id may be acquired too
    assert (pool.ref_count(1), pool.num_free) == (2, 1)
    before = _state(pool)
    with pytest.raises(ValueError, match="double free"):
        pool.release([1, 1, 1])
    assert _state(pool) == before
    pool.release([1, 1])
    assert (pool.ref_count(1), pool.num_free) == (0, 2)
    pool.check()


def test_double_free_raises_and_changes_nothing() -> None:
    pool = PrefixBlockPool(4, "kv")
    ids = pool.allocate(3)
    pool.release([ids[2]])
    before = _state(pool)
    # The valid ids come first: a release that did not validate up front would already have changed them.
    with pytest.raises(ValueError, match="double free"):
        pool.release(ids)
    with pytest.raises(ValueError, match="not in this pool"):
        pool.release([ids[0], 99])
    assert _state(pool) == before
    pool.check()


def test_publish_duplicate_hash_returns_false_and_stays_private() -> None:
    pool = PrefixBlockPool(3, "kv")
    h, key = _key(4, 5)
    a, b = pool.allocate(2)
    assert pool.publish(a, h, key) is True
    assert pool.publish(b, h, key) is False
    assert (pool.hash_of(b), pool.num_cached, pool.lookup(h, key)) == (None, 1, a)
    pool.release([b])
    assert pool.allocate(2) == [2, b]
    assert pool.lookup(h, key) == a
    pool.check()


def test_publish_rejects_free_or_already_hashed_ids() -> None:
    pool = PrefixBlockPool(2, "kv")
    (h1, k1), (h2, k2) = _key(1), _key(2)
    with pytest.raises(ValueError, match="free"):
        pool.publish(0, h1, k1)
    (a,) = pool.allocate(1)
    assert pool.publish(a, h1, k1)
    with pytest.raises(ValueError, match="already published"):
        pool.publish(a, h2, k2)
    assert (pool.hash_of(a), pool.num_cached) == (h1, 1)


def test_hash_collision_with_a_different_key_misses() -> None:
    pool = PrefixBlockPool(2, "kv")
    h, key = _key(1, 2, 3)
    (a,) = pool.allocate(1)
    pool.publish(a, h, key)
    # Different prefixes whose hash (forged here) collides with h must not be served a's state.
    forged = [BlockKey(ROOT_HASH, (1, 2, 4)), BlockKey(ROOT_HASH, (1, 2, 3), ("lora",)), BlockKey(h, (1, 2, 3))]
    assert [pool.lookup(h, k) for k in forged] == [None] * 3
    assert pool.lookup(h, BlockKey(ROOT_HASH, (1, 2, 3))) == a
    assert pool.lookup(_key(7)[0], key) is None


def test_reset_cache_drops_only_free_hashed_ids() -> None:
    pool = PrefixBlockPool(4, "kv")
    keys = [_key(i) for i in range(3)]
    ids = pool.allocate(3)
    for i, (h, key) in zip(ids, keys, strict=True):
        pool.publish(i, h, key)
    pool.release(ids[1:])
    assert pool.reset_cache() == 2
    assert (pool.num_cached, pool.num_free, pool.lookup(*keys[0])) == (1, 3, ids[0])
    assert pool.lookup(*keys[1]) is None and pool.hash_of(ids[1]) is None
    pool.check()
    assert pool.reset_cache() == 0


def test_check_catches_corruption() -> None:
    pool = PrefixBlockPool(3, "kv")
    h, key = _key(1)
    (a,) = pool.allocate(1)
    pool.publish(a, h, key)
    pool.check()
    pool._keys[a] = BlockKey(ROOT_HASH, (2,))
    with pytest.raises(AssertionError, match="does not hash"):
        pool.check()
    pool._keys[a] = key
    pool._free[a] = None  # an in-use id in the free queue
    with pytest.raises(AssertionError, match="free queue"):
        pool.check()
    del pool._free[a]
    del pool._by_hash[h]
    with pytest.raises(AssertionError, match="not in the hash map"):
        pool.check()


NUM_IDS, OFFSET = 6, 100
CONTENTS = [_key(t) for t in range(5)]  # few contents: duplicate publishes, hits and evictions happen often


class PoolMachine(RuleBasedStateMachine):
    """Drives a small pool with random operations and compares it to a plain-Python model."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = PrefixBlockPool(NUM_IDS, "kv", id_offset=OFFSET)
        self.counts = {i: 0 for i in range(OFFSET, OFFSET + NUM_IDS)}
        self.free = list(range(OFFSET, OFFSET + NUM_IDS))  # LRU order, head first
        self.published: dict[BlockHash, int] = {}
        self.held: list[int] = []  # one entry per reference the "requests" hold

    def _hash_of(self, id: int) -> BlockHash | None:
        return next((h for h, i in self.published.items() if i == id), None)

    @rule(n=st.integers(0, NUM_IDS + 1))
    def allocate(self, n: int) -> None:
        if n > len(self.free):
            with pytest.raises(PoolExhausted):
                self.pool.allocate(n)
            return
        expected, self.free = self.free[:n], self.free[n:]
        assert self.pool.allocate(n) == expected
        self.published = {h: i for h, i in self.published.items() if i not in expected}
        self.counts.update(dict.fromkeys(expected, 1))
        self.held += expected

    @rule(data=st.data(), content=st.sampled_from(CONTENTS))
    def publish(self, data: st.DataObject, content: tuple[BlockHash, BlockKey]) -> None:
        candidates = sorted({i for i in self.held if self._hash_of(i) is None})
        if candidates:
            id = data.draw(st.sampled_from(candidates))
            expected = content[0] not in self.published
            assert self.pool.publish(id, *content) is expected
            if expected:
                self.published[content[0]] = id

    @rule(content=st.sampled_from(CONTENTS), other=st.sampled_from(CONTENTS))
    def lookup_and_acquire(self, content: tuple[BlockHash, BlockKey], other: tuple[BlockHash, BlockKey]) -> None:
        h, key = content
        if other[1] != key:
            assert self.pool.lookup(h, other[1]) is None  # same hash, different key: a collision
        hit = self.pool.lookup(h, key)
        assert hit == self.published.get(h)
        if hit is not None:
            self.pool.acquire([hit])
            if self.counts[hit] == 0:
                self.free.remove(hit)
            self.counts[hit] += 1
            self.held.append(hit)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        picks = data.draw(st.lists(st.integers(0, len(self.held) - 1), unique=True, min_size=1))
        picks.sort(reverse=True)
        ids = [self.held.pop(p) for p in picks]
        self.pool.release(ids)
        for i in ids:
            self.counts[i] -= 1
            if self.counts[i] == 0:
                self.free.append(i)

    @rule(data=st.data())
    def bad_release(self, data: st.DataObject) -> None:
        zero = [i for i, c in self.counts.items() if c == 0]
        bad = data.draw(st.sampled_from([*zero, OFFSET - 1, OFFSET + NUM_IDS]))
        before = _state(self.pool)
        with pytest.raises(ValueError):
            self.pool.release([*self.held[:1], bad])
        assert _state(self.pool) == before

    @rule()
    def reset_cache(self) -> None:
        dropped = [h for h, i in self.published.items() if self.counts[i] == 0]
        assert self.pool.reset_cache() == len(dropped)
        for h in dropped:
            del self.published[h]

    @invariant()
    def matches_model(self) -> None:
        self.pool.check()
        assert (self.pool.num_free, self.pool.num_cached) == (len(self.free), len(self.published))
        for i, c in self.counts.items():
            assert (self.pool.ref_count(i), self.pool.hash_of(i)) == (c, self._hash_of(i))

    def teardown(self) -> None:
        self.pool.release(self.held[::-1])
        self.pool.check()
        assert self.pool.num_free == self.pool.size


PoolMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_pool_state_machine = PoolMachine.TestCase
