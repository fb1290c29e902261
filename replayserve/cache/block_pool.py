"""Fixed pools of KV blocks and Mamba state slots; pure bookkeeping, no tensors."""

from __future__ import annotations

from collections import deque


class PoolExhausted(RuntimeError):
    pass


class IdPool:
    """A free list of integer ids with double-free and foreign-id checks."""

    def __init__(self, size: int, name: str) -> None:
        self.size = size
        self.name = name
        self._free: deque[int] = deque(range(size))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise PoolExhausted(f"{self.name}: asked for {n}, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        self._used.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.name}: id {i} freed twice or never allocated")
            self._used.remove(i)
            self._free.append(i)


class KVBlockManager:
    """Maps each request to the KV blocks holding its positions."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = IdPool(num_blocks, "KV blocks")
        self.tables: dict[str, list[int]] = {}

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        """Extra blocks the request needs to hold `num_tokens` positions."""
        have = len(self.tables.get(request_id, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.blocks_needed(request_id, num_tokens) <= self.pool.num_free

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        """Grows the request's table to cover `num_tokens` positions; returns the whole table."""
        table = self.tables.setdefault(request_id, [])
        table.extend(self.pool.allocate(self.blocks_needed(request_id, num_tokens)))
        return table

    def free(self, request_id: str) -> None:
        self.pool.free(self.tables.pop(request_id, []))
