"""The argument checks the conv1d references (`conv1d.py`) and kernels (`conv1d_triton.py`,
`conv1d_varlen_triton.py`) share: a module of their own, so that the kernels, which `conv1d.py`
runs where they serve, need not import it back."""

from __future__ import annotations

from torch import Tensor


def check_activation(activation: str | None) -> None:
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")


def check_pool(conv_state: Tensor, state_indices: Tensor, batch: int, dim: int, width: int) -> None:
    if conv_state.shape[1:] != (dim, width - 1):
        raise ValueError(f"conv_state must be (S, {dim}, {width - 1}), got {tuple(conv_state.shape)}")
    if state_indices.shape != (batch,):
        raise ValueError(f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
