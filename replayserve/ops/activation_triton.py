"""Triton relu(x)^2 in one launch (``relu_square_ref`` takes two kernels and a temporary), and
SwiGLU's silu(gate) * up in one launch (``silu_mul_ref`` takes two).

In fp32 the square of a bf16 or fp16 value is exact, so the one rounding to x's dtype gives what
PyTorch's relu then square give. The grid depends on the shape only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
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


@triton.jit
def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, n, s_g, s_u, s_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    gate = tl.load(gate_ptr + row * s_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(up_ptr + row * s_u + offs, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # rounded as PyTorch's silu kernel rounds
    tl.store(out_ptr + row * s_o + offs, (silu * up).to(dtype), mask=mask)


def silu_mul_triton(gate: Tensor, up: Tensor) -> Tensor:
    """``silu_mul_ref`` on the GPU: gate and up (T, N) fp32, bf16 or fp16 with unit column stride
    (any row strides) -> a new contiguous (T, N)."""
    if gate.shape != up.shape or gate.dim() != 2 or gate.stride(1) != 1 or up.stride(1) != 1:
        raise ValueError("silu_mul_triton needs 2-D gate and up of one shape with unit column stride")
    rows, n = gate.shape
    out = torch.empty(rows, n, dtype=gate.dtype, device=gate.device)
    if out.numel():
        block = min(_BLOCK, triton.next_power_of_2(n))
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate, up, out, n, gate.stride(0), up.stride(0), out.stride(0),
                                                        BLOCK=block, num_warps=4)
    return out
