"""Activations of the feed-forward layers (plain PyTorch; the Triton kernel beside it must match)."""

from __future__ import annotations

from torch import Tensor


def relu_square_ref(x: Tensor) -> Tensor:
    """Nemotron-H's MLP activation, relu(x)^2: x (...,) any float dtype -> the same shape and dtype."""
    return x.relu().square()
