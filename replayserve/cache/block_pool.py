"""A fixed pool of integer ids (live Mamba state slots); pure bookkeeping, no tensors."""

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
