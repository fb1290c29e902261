"""What a Mamba2 mixer hands its state backend besides activations: its weights (`MambaParams`) and
the step's prefill sequences (`Segment`). Apart from `backend.py` so that the backends and the packed
prefill kernels' driver (`packed_prefill.py`) share them without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# A step's prefill sequence: (token start, token end, state slot, captures, first position), as
# `StepContext.prefill_segments()` lists them; captures as in `SSMBackend.prefill`.
Segment = tuple[int, int, int, tuple[tuple[int, int], ...], int]


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
