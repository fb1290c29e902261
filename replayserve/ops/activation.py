"""Activations of the feed-forward layers: the reference, and the entry point that runs the kernel
of ``activation_triton`` where it serves (``dispatch.use_triton``)."""

from __future__ import annotations

import torch.nn.functional as F
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


def silu_mul_ref(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's product silu(gate) * up: gate and up (T, N) of one float dtype -> (T, N) in it
    (silu rounded to that dtype before the product, as PyTorch's two kernels round it)."""
    return F.silu(gate) * up


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """``silu_mul_ref``; one kernel where it serves (2-D inputs with unit column stride: the halves
    of one projection's output qualify), writing a new contiguous tensor."""
    if (use_triton(gate) and gate.dim() == up.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype
            and gate.stride(1) == up.stride(1) == 1):
        from replayserve.ops.activation_triton import silu_mul_triton

        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)
