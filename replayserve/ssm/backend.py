"""The seam between a Mamba2 mixer and the state it reads and writes."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from replayserve.ssm.layout import MambaLayout


@dataclass(frozen=True)
class MambaParams:
    """One Mamba2 layer's weights that the state update needs.

    conv_weight (conv_dim, K); conv_bias (conv_dim,) or None; A, D, dt_bias (H,) in the state's
    compute dtype; dt_limit clamps the processed time step.
    """

    conv_weight: torch.Tensor
    conv_bias: torch.Tensor | None
    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float]
    chunk_size: int


class SSMBackend(ABC):
    """Owns the conv and SSM state of every Mamba layer, indexed by state slot."""

    layout: MambaLayout

    @abstractmethod
    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zeroes every layer's state of `slots` (int64, on the device): a fresh request."""

    @abstractmethod
    def prefill(
        self, layer: int, slot: int, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams
    ) -> torch.Tensor:
        """Runs one sequence's prefill chunk from the state in `slot` and stores the state after it.

        xbc: (L, conv_dim) pre-conv inputs; dt: (L, H) raw time steps. Returns y (L, H, P).
        """

    @abstractmethod
    def decode(
        self, layer: int, slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams
    ) -> torch.Tensor:
        """Advances each row's slot by one token.

        slots: (B,) int64; xbc: (B, conv_dim); dt: (B, H). Returns y (B, H, P).
        """

    def memory_bytes(self) -> int:
        """Bytes of all state tensors this backend allocated."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    @abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds per-slot state."""
