"""The projections' linear op: one half-precision row on the GPU runs the Triton GEMV of
``gemv_triton`` (faster than cuBLAS's split-K kernels there, 2.6-4.1 against 2.2-3.1 TB/s);
every other input, and anything that needs autograd, is ``F.linear``. Four rows already lose
(the kernel rereads W per row), so it takes one. ``gemv_ref`` is the kernel's reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype

_GEMV_DTYPES = (torch.bfloat16, torch.float16)  # float32 and float64 models never take the kernel


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: (1, K); weight: (N, K); bias: (N,) or None. Returns (1, N) in x.dtype, computed in
    ``compute_dtype`` (fp32 for half inputs)."""
    wide = compute_dtype(x.dtype)
    y = x.to(wide) @ weight.to(wide).t()
    if bias is not None:
        y = y + bias.to(wide)
    return y.to(x.dtype)


def gemv_serves(x: Tensor, weight: Tensor) -> bool:
    """Whether ``linear(x, weight)`` runs the Triton GEMV: x one bf16/fp16 row (1, K) where the
    kernels serve, weight of x's dtype, and no autograd through the weight."""
    return (x.dim() == 2 and x.shape[0] == 1 and use_triton(x, _GEMV_DTYPES) and weight.dtype == x.dtype
            and not (torch.is_grad_enabled() and weight.requires_grad))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``, by the Triton GEMV where it serves (``gemv_serves``)."""
    if gemv_serves(x, weight):
        from replayserve.ops.gemv_triton import gemv_triton

        return gemv_triton(x, weight, bias)
    return F.linear(x, weight, bias)
