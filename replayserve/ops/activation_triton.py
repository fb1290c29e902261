"""Triton relu(x)^2 in one launch (``relu_square_ref`` takes two kernels and a temporary).

In fp32 the square of a bf16 or fp16 value is exact, so the one rounding to x's dtype gives what
PyTorch's relu then square give. The grid depends on the shape only (CUDA-graph safe).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

_BLOCK = 2048


@triton.jit
def _relu_square_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32), 0.0)
    tl.store(out_ptr + offs, (x * x).to(out_ptr.dtype.element_ty), mask=mask)


def relu_square_triton_(x: Tensor) -> Tensor:
    """``relu_square_ref`` on the GPU, IN PLACE: x (...,) contiguous fp32, bf16 or fp16; returns x."""
    if not x.is_contiguous():
        raise ValueError("relu_square_triton_ needs a contiguous tensor")
    n = x.numel()
    if n:
        _relu_square_kernel[(triton.cdiv(n, _BLOCK),)](x, x, n, BLOCK=_BLOCK, num_warps=4)
    return x
