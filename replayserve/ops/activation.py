"""Activations of the feed-forward layers: the reference, and the entry point that runs the kernel
of ``activation_triton`` where it serves (``dispatch.use_triton``)."""

from __future__ import annotations

from torch import Tensor

from replayserve.ops.dispatch import use_triton


def relu_square_ref(x: Tensor) -> Tensor:
    """Nemotron-H's MLP activation, relu(x)^2: x (...,) any float dtype -> the same shape and dtype."""
    return x.relu().square()


def relu_square(x: Tensor) -> Tensor:
    """``relu_square_ref``; where the kernel serves a contiguous x it writes the result over x (one
    launch, no temporary), so x must not be used afterwards."""
    if use_triton(x) and x.is_contiguous():
        from replayserve.ops.activation_triton import relu_square_triton_

        return relu_square_triton_(x)
    return relu_square_ref(x)
