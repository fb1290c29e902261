"""A reference-counted id pool with published hashes and an LRU queue of free ids; pure bookkeeping.

One pool serves one cache group: attention KV blocks, or Mamba boundary-state slots. A free id that
still holds a hash stays findable until `allocate` takes it from the head of the free queue.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from replayserve.cache.block_pool import PoolExhausted
from replayserve.cache.hashing import BlockHash, BlockKey, hash_block


class PrefixBlockPool:
    """A fixed set of ids (KV blocks, or Mamba boundary-state slots) with reference counts, an optional
    published hash each, a hash -> id map and an LRU queue of the free ids (count 0)."""

    def __init__(self, num_blocks: int, name: str, id_offset: int = 0) -> None:
        """Ids are id_offset .. id_offset + num_blocks - 1; all start free, unhashed, ascending in the queue."""
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.size = num_blocks
        self._offset = id_offset
        self._counts = [0] * num_blocks
        self._hashes: list[BlockHash | None] = [None] * num_blocks
        self._keys: list[BlockKey | None] = [None] * num_blocks
        self._by_hash: dict[BlockHash, int] = {}
        # Ordered by the time each id became free; head = least recently freed = next to evict.
        self._free: OrderedDict[int, None] = OrderedDict((id_offset + i, None) for i in range(num_blocks))

    @property
    def num_free(self) -> int:
        """Ids with count 0, cached or not."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Ids currently published (in the hash map), in use or free."""
        return len(self._by_hash)

    def _index(self, id: int) -> int:
        i = id - self._offset
        if not 0 <= i < self.size:
            raise ValueError(
                f"{self.name}: id {id} is not in this pool (ids {self._offset}..{self._offset + self.size - 1})"
            )
        return i

    def _unpublish(self, i: int) -> None:
        h = self._hashes[i]
        if h is not None:
            del self._by_hash[h]
            self._hashes[i] = None
            self._keys[i] = None

    def allocate(self, n: int = 1) -> list[int]:
        """Takes n ids from the head of the free queue, evicting any hash they held; each gets count 1.

        Raises:
            PoolExhausted: n > num_free (nothing changes).
        """
        if n < 0:
            raise ValueError(f"{self.name}: cannot allocate {n} ids")
        if n > len(self._free):
            raise PoolExhausted(
                f"{self.name}: asked for {n} ids, {len(self._free)} free of {self.size} ({self.num_cached} cached)"
            )
        ids = []
        for _ in range(n):
            id, _ = self._free.popitem(last=False)
            i = id - self._offset
            self._unpublish(i)
            self._counts[i] = 1
            ids.append(id)
        return ids

    def lookup(self, h: BlockHash, key: BlockKey) -> int | None:
        """The id published under h whose stored key equals key, else None; counts and LRU unchanged."""
        id = self._by_hash.get(h)
        if id is None or self._keys[id - self._offset] != key:
            return None
        return id

    def acquire(self, ids: Sequence[int]) -> None:
        """Adds one reference to each id; a free id leaves the free queue and keeps its hash.

        Raises:
            ValueError: an id is not in this pool (nothing changes).
        """
        indices = [self._index(id) for id in ids]
        for id, i in zip(ids, indices, strict=True):
            if self._counts[i] == 0:
                del self._free[id]
            self._counts[i] += 1

    def release(self, ids: Sequence[int]) -> None:
        """Drops one reference from each id in order; ids reaching 0 join the free queue's tail in that order.

        Callers pass a request's blocks in reverse, so a sequence's tail is evicted before its head.

        Raises:
            ValueError: an id is not in this pool, or would be released more often than it is referenced
                (double free); all ids are checked first, so nothing changes.
        """
        indices = [self._index(id) for id in ids]
        for i, times in Counter(indices).items():
            if times > self._counts[i]:
                raise ValueError(
                    f"{self.name}: id {i + self._offset} released {times} time(s) but has {self._counts[i]} "
                    "reference(s) (double free?)"
                )
        for id, i in zip(ids, indices, strict=True):
            self._counts[i] -= 1
            if self._counts[i] == 0:
                self._free[id] = None

    def publish(self, id: int, h: BlockHash, key: BlockKey) -> bool:
        """Maps h -> id and stores key, unless h is already published (then returns False, id stays private).

        The caller passes h = hash_block(key); `check` verifies it.

        Raises:
            ValueError: id is not in this pool, is free, or already holds a hash.
        """
        i = self._index(id)
        if self._counts[i] < 1:
            raise ValueError(f"{self.name}: cannot publish free id {id}; publish only ids you hold")
        if self._hashes[i] is not None:
            raise ValueError(f"{self.name}: id {id} is already published")
        if h in self._by_hash:
            return False
        self._by_hash[h] = id
        self._hashes[i] = h
        self._keys[i] = key
        return True

    def ref_count(self, id: int) -> int:
        """References held on id."""
        return self._counts[self._index(id)]

    def key_of(self, id: int) -> BlockKey | None:
        """The key ``id`` is published under, or None."""
        return self._keys[self._index(id)]

    def hash_of(self, id: int) -> BlockHash | None:
        """The hash id is published under, or None."""
        return self._hashes[self._index(id)]

    def reset_cache(self) -> int:
        """Unpublishes every free hashed id (in-use ids keep their hash); returns how many were dropped."""
        dropped = 0
        for id in self._free:
            i = id - self._offset
            if self._hashes[i] is not None:
                self._unpublish(i)
                dropped += 1
        return dropped

    def check(self) -> None:
        """Raises AssertionError unless the counts, free queue, hash map and stored keys agree."""
        problems: list[str] = []
        free_ids = {self._offset + i for i, c in enumerate(self._counts) if c == 0}
        if any(c < 0 for c in self._counts):
            problems.append("negative reference count")
        # The queue is an OrderedDict, so it cannot hold an id twice; it must hold exactly the free ids.
        if set(self._free) != free_ids:
            problems.append(f"free queue {list(self._free)} != ids with count 0 {sorted(free_ids)}")
        for h, id in self._by_hash.items():
            i = id - self._offset
            if not 0 <= i < self.size or self._hashes[i] != h:
                problems.append(f"hash map entry {h.hex()[:16]} -> {id} disagrees with the id's hash")
                continue
            key = self._keys[i]
            if key is None or hash_block(key) != h:
                problems.append(f"id {id}: stored key does not hash to {h.hex()[:16]}")
        for i, h in enumerate(self._hashes):
            if h is None and self._keys[i] is not None:
                problems.append(f"id {i + self._offset}: key stored without a hash")
            if h is not None and self._by_hash.get(h) != i + self._offset:
                problems.append(f"id {i + self._offset}: hash {h.hex()[:16]} is not in the hash map")
        if problems:
            raise AssertionError(f"{self.name}: " + "; ".join(problems))
