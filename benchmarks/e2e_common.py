"""Small helpers the end-to-end benchmarks share: device syncs, the collector held off while
timing, freeing memory between rows, random prompts."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator

import torch


def sync_fn(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


@contextlib.contextmanager
def gc_off() -> Iterator[None]:
    """The collector's pauses would land in whichever step they hit."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=gen).tolist()
