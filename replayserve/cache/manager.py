"""Who owns which KV block and Mamba state slot, and which prefixes are cached: plain data, no tensors.

Attention KV lives in blocks of ``block_size`` tokens, a request's block table maps its positions
to them, and a full block may be published under the chained hash of its tokens. Mamba state
lives in slots: every running request has one private live slot, and, when Mamba states are
cached, a separate pool of boundary slots holds canonical states on a coarser grid of
``state_block`` tokens (a multiple of ``block_size``), keyed by the hash of the attention block
that ends there (it fingerprints the whole prefix).

A prefix hit of ``p`` tokens needs every KV block of ``[0, p)`` and a boundary state at ``p``
(design: ``docs/prefix-cache.md``, Lookup); it never covers a request's last known token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from replayserve.cache.block_pool import IdPool
from replayserve.cache.hashing import BlockHash, BlockKey, block_keys
from replayserve.cache.prefix_pool import PrefixBlockPool


class Request(Protocol):
    """What the cache reads of a request (the engine's `engine.request.Request` is one): its id, its
    tokens, its live state slot and how many tokens are computed; it keeps the request's block keys
    and hashes on it, extended as the request grows."""

    request_id: str
    extra_keys: tuple
    block_keys: list
    block_hashes: list
    state_slot: int | None
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...

    @property
    def num_tokens(self) -> int: ...


@dataclass(frozen=True)
class PrefixHit:
    """What a lookup found for a request's known tokens; reported in tokens."""

    num_tokens: int  # usable: KV blocks of [0, num_tokens) and, for Mamba models, the state at num_tokens
    kv_blocks: tuple[int, ...] = ()
    state_slot: int | None = None  # boundary slot to copy into the live slot
    attention_tokens: int = 0  # deepest run of cached KV blocks (capped like num_tokens)
    mamba_tokens: int = 0  # deepest boundary with a cached state (capped like num_tokens)


NO_HIT = PrefixHit(0)


@dataclass(frozen=True)
class BoundaryWrite:
    """A canonical Mamba state to write into ``slot`` once the step has computed ``position``."""

    position: int
    slot: int
    block_hash: BlockHash | None  # None inside a verify's drafts: hashed once they are accepted
    key: BlockKey | None


@dataclass
class CacheMetrics:
    """Prefix-cache counters in tokens, per group and for the usable (hybrid) hit."""

    queries: int = 0
    hits: int = 0
    attention_hits: int = 0
    mamba_hits: int = 0
    published_blocks: int = 0
    published_states: int = 0

    def as_dict(self) -> dict[str, float]:
        rate = self.hits / self.queries if self.queries else 0.0
        return {"prefix_cache_queries": self.queries, "prefix_cache_hits": self.hits,
                "prefix_cache_hit_rate": rate, "prefix_cache_attention_hits": self.attention_hits,
                "prefix_cache_mamba_hits": self.mamba_hits, "prefix_cache_published_blocks": self.published_blocks,
                "prefix_cache_published_states": self.published_states}


@dataclass
class _Owned:
    """One request's holdings: its block table and how many leading blocks are known to be
    published (hit blocks count). The table is a tuple, replaced when it grows: every step hands
    it to the plan as it is, with no copy."""

    table: tuple[int, ...] = ()
    published: int = 0


class CacheManager:
    """The hybrid coordinator: both groups' pools, per-request tables, lookups and publishing."""

    def __init__(self, num_kv_blocks: int, block_size: int, num_live_slots: int, num_state_slots: int = 0,
                 enable_caching: bool = False, has_mamba: bool = True, state_block: int | None = None) -> None:
        self.block_size = block_size
        self.state_block = state_block or block_size
        if self.state_block % block_size:
            raise ValueError(f"state_block={self.state_block} must be a multiple of block_size={block_size}")
        self.enable_caching = enable_caching
        self.has_mamba = has_mamba
        self.kv = PrefixBlockPool(num_kv_blocks, "KV blocks")
        self.live = IdPool(num_live_slots, "Mamba state slots")
        # Boundary slots are numbered after the live ones: both index the same state tensors.
        self.states = (PrefixBlockPool(num_state_slots, "Mamba boundary states", id_offset=num_live_slots)
                       if enable_caching and has_mamba and num_state_slots else None)
        self.owned: dict[str, _Owned] = {}
        self.metrics = CacheMetrics()
        # Boundary-slot references the step being planned or run holds (planned writes, hit states
        # to copy): each is dropped once, when published or released, and `end_step` drops the rest,
        # so a step that raises anywhere cannot leak one or drop one twice.
        self._step_refs: list[int] = []

    # -- hashing -------------------------------------------------------------------------------
    def _hashed(self, request: Request) -> tuple[list[BlockKey], list[BlockHash]]:
        """Keys and hashes of the request's full blocks, kept on the request and extended as it
        grows, so a prompt is hashed once (lookups while it waits and admission share them)."""
        if len(request.block_hashes) < request.num_tokens // self.block_size:  # no token list built per step
            request.block_keys, request.block_hashes = block_keys(
                request.all_token_ids, self.block_size, request.extra_keys, request.block_hashes, request.block_keys)
        return request.block_keys, request.block_hashes

    # -- lookup --------------------------------------------------------------------------------
    def find_hit(self, request: Request) -> PrefixHit:
        """The longest usable prefix of the request's known tokens; takes no references."""
        if not self.enable_caching:
            return NO_HIT
        cap = (request.num_tokens - 1) // self.block_size
        keys, hashes = self._hashed(request)
        blocks: list[int] = []
        for key, h in zip(keys[:cap], hashes[:cap], strict=True):
            block = self.kv.lookup(h, key)
            if block is None:
                break
            blocks.append(block)
        bs = self.block_size
        if not self.has_mamba:
            return PrefixHit(len(blocks) * bs, tuple(blocks), None, len(blocks) * bs, 0)
        usable, slot, deepest_state = 0, None, 0
        if self.states is not None:
            every = self.state_block // bs  # blocks per grid step
            for k in range(cap // every * every, 0, -every):
                found = self.states.lookup(hashes[k - 1], keys[k - 1])
                if found is None:
                    continue
                deepest_state = max(deepest_state, k)
                if k <= len(blocks):
                    usable, slot = k, found
                    break
        return PrefixHit(usable * bs, tuple(blocks[:usable]), slot, len(blocks) * bs, deepest_state * bs)

    # -- admission and growth ------------------------------------------------------------------
    def _new_blocks(self, owned_blocks: int, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - owned_blocks)

    def can_admit(self, hit: PrefixHit, num_tokens: int) -> bool:
        """A live slot is free and the pool can hold ``num_tokens`` positions on top of the hit."""
        revived = sum(self.kv.ref_count(b) == 0 for b in hit.kv_blocks)  # free cached blocks leave the queue
        need = self._new_blocks(len(hit.kv_blocks), num_tokens) + revived
        return self.live.num_free > 0 and need <= self.kv.num_free

    def admit(self, request: Request, hit: PrefixHit, num_tokens: int) -> int:
        """Takes the hit's blocks (and its state slot, until ``end_step``), grows the table to
        ``num_tokens`` positions and returns the request's new live slot."""
        owned = _Owned(published=len(hit.kv_blocks))
        self.kv.acquire(hit.kv_blocks)
        owned.table = tuple(hit.kv_blocks)
        owned.table += tuple(self.kv.allocate(self._new_blocks(len(owned.table), num_tokens)))
        if hit.state_slot is not None:
            assert self.states is not None
            self.states.acquire([hit.state_slot])
            self._step_refs.append(hit.state_slot)
        self.owned[request.request_id] = owned
        if self.enable_caching:  # find_hit hashed the prompt already
            self.metrics.queries += request.num_tokens
            self.metrics.hits += hit.num_tokens
            self.metrics.attention_hits += hit.attention_tokens
            self.metrics.mamba_hits += hit.mamba_tokens
        return self.live.allocate()[0]

    def _drop_step_ref(self, slot: int) -> None:
        assert self.states is not None
        self._step_refs.remove(slot)  # forgotten first: an interrupt here leaks, never double-frees
        self.states.release([slot])

    def end_step(self) -> None:
        """Drops every boundary-slot reference the step still holds: the hit states it copied and
        planned writes that were not published (the step ended or raised)."""
        while self._step_refs:
            self._drop_step_ref(self._step_refs[-1])

    def holds(self, request_id: str, num_tokens: int) -> bool:
        """The request's blocks already cover ``num_tokens`` positions (most decode steps)."""
        return num_tokens <= len(self.owned[request_id].table) * self.block_size

    def new_blocks(self, request_id: str, num_tokens: int) -> int:
        """KV blocks the request needs beyond its table to hold ``num_tokens`` positions."""
        return self._new_blocks(len(self.owned[request_id].table), num_tokens)

    def can_grow(self, request_id: str, num_tokens: int) -> bool:
        return self._new_blocks(len(self.owned[request_id].table), num_tokens) <= self.kv.num_free

    def grow(self, request_id: str, num_tokens: int) -> None:
        owned = self.owned[request_id]
        owned.table += tuple(self.kv.allocate(self._new_blocks(len(owned.table), num_tokens)))

    def table(self, request_id: str) -> tuple[int, ...]:
        return self.owned[request_id].table

    def free(self, request: Request) -> None:
        """Returns the request's blocks (tail first, so its tail is evicted first) and live slot.
        Published blocks stay findable until evicted."""
        owned = self.owned.pop(request.request_id)
        self.kv.release(owned.table[::-1])
        if request.state_slot is not None:
            self.live.free([request.state_slot])

    # -- publishing ----------------------------------------------------------------------------
    def plan_boundaries(self, request: Request, start: int, num_tokens: int, every: bool,
                        also: tuple[int, ...] = ()) -> list[BoundaryWrite]:
        """Boundary states this step will produce for the request's tokens ``[start, start + n)``:
        every grid boundary crossed (``every``, mode ``all``) or the last one crossed and the grid
        points in ``also`` (``align``). Boundaries already cached are skipped; so are those no
        free slot can take."""
        grid, end = self.state_block, start + num_tokens
        if self.states is None or end // grid == start // grid:  # no grid point in (start, end]
            return []
        if every:
            points = range((start // grid + 1) * grid, end + 1, grid)
        else:
            points = sorted({p for p in (*also, end // grid * grid) if start < p <= end and p % grid == 0})
        if not points:
            return []
        keys, hashes = self._hashed(request)
        writes = []
        for b in points:
            k = b // self.block_size  # the attention block ending at b keys the state
            known = k <= len(hashes)
            if self.states.num_free == 0 or (known and self.states.lookup(hashes[k - 1], keys[k - 1]) is not None):
                continue
            slot = self.states.allocate()[0]
            self._step_refs.append(slot)
            writes.append(BoundaryWrite(b, slot, *(hashes[k - 1], keys[k - 1]) if known else (None, None)))
        return writes

    def publish(self, request: Request, writes: tuple[BoundaryWrite, ...]) -> None:
        """After a step: publish the request's newly full KV blocks and its boundary states, which
        the runner has written by now; a state some other request published first is dropped."""
        owned = self.owned[request.request_id] if self.enable_caching else None
        if owned is not None and request.num_computed_tokens // self.block_size > owned.published:
            keys, hashes = self._hashed(request)
            full = min(request.num_computed_tokens // self.block_size, len(hashes))
            for i in range(owned.published, full):
                self.metrics.published_blocks += self.kv.publish(owned.table[i], hashes[i], keys[i])
            owned.published = max(owned.published, full)
        for w in writes:  # a verify's boundaries past its accepted tokens were never written
            assert self.states is not None
            if w.position <= request.num_computed_tokens:
                h, key = w.block_hash, w.key
                if h is None:  # the block ended in accepted drafts, known by now
                    keys, hashes = self._hashed(request)
                    h, key = hashes[w.position // self.block_size - 1], keys[w.position // self.block_size - 1]
                self.metrics.published_states += self.states.publish(w.slot, h, key)
            self._drop_step_ref(w.slot)

    def reset_cache(self) -> int:
        """Forgets every cached prefix no request holds (KV blocks and boundary states); returns
        how many entries were dropped."""
        return self.kv.reset_cache() + (self.states.reset_cache() if self.states is not None else 0)

    def check(self) -> None:
        """Raises AssertionError unless the pools agree with the requests' holdings."""
        if self._step_refs:
            raise AssertionError(f"boundary slots {self._step_refs} are still held by a step that ended")
        self.kv.check()
        counts: dict[int, int] = {}
        for owned in self.owned.values():
            for b in owned.table:
                counts[b] = counts.get(b, 0) + 1
        for b in range(self.kv.size):
            if self.kv.ref_count(b) != counts.get(b, 0):
                raise AssertionError(f"KV block {b}: count {self.kv.ref_count(b)}, held {counts.get(b, 0)} times")
        if self.states is not None:
            self.states.check()
