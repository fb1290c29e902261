"""RMS norms holding their Hugging Face-named weight."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.ops.norm import add_rms_norm, gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add and the next pre-norm in one pass,
        exactly what `residual = x + residual; norm(residual)` gives."""
        return add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """y * silu(z), normalised per group of `group_size` channels."""

    def __init__(self, hidden_size: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, self.group_size)
