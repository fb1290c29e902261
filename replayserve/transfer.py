"""Host-to-device copies that do not stall the stream."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`. On CUDA it goes through pinned memory, so the copy is
    asynchronous: from pageable memory CUDA would first wait for everything queued on the stream.
    The caching host allocator keeps the pinned block until the copy has finished."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
