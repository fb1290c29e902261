"""RMS norms holding their Hugging Face-named weight."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.ops.dtypes import compute_dtype
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
    """y * silu(z), normalised per group of `group_size` channels; with `norm_before_gate` (Falcon-H1's
    option) y normalised, then gated."""

    def __init__(self, hidden_size: int, group_size: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.group_size = group_size
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, z, self.weight, self.eps, self.group_size, self.norm_before_gate)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), the weight zero-initialised (Qwen3-Next's and Qwen3.5's
    norms). 1 + weight is formed in the compute dtype, as transformers does, and kept until the
    weight changes (a new tensor or an in-place write bumps its version)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def scale(self) -> torch.Tensor:
        """(D,) 1 + weight in the compute dtype."""
        w = self.weight
        key = (w.dtype, id(w), w._version, w.data_ptr())
        if getattr(self, "_scale_key", None) != key:
            with torch.no_grad():
                self._scale = 1.0 + w.to(compute_dtype(w.dtype))
            self._scale_key = key
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.scale(), self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), as `RMSNorm.add_forward`."""
        return add_rms_norm(x, residual, self.scale(), self.eps)
