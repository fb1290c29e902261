"""Activation quantization for the FP8 GEMM in one Triton launch: what ``quantize_fp8`` (a static
``input_scale``) and ``quantize_fp8_rows`` (a dynamic scale per row) compute in plain PyTorch.

Done with torch ops, a dynamic per-tensor scale took an abs, an amax, a where, a divide, a clamp and
a cast: about eight small kernels before every FP8 GEMM of a decode step, which on the H100 cost
more than FP8 saved (Nemotron-H-8B shape, batch 64: 2.4 ms of such kernels in a 10.8 ms step,
2026-12-07). Here each program reads a row, finds its largest magnitude (dynamic) and writes the
FP8 codes, so the activations are read twice (the second time mostly from L2) and written once.

Per-row (per-token) dynamic scales follow vLLM's dynamic FP8: a row's codes use its own range, so an
outlier token does not crush the others' precision, and ``torch._scaled_mm`` applies them in its
epilogue (row-wise scaling). The Triton interpreter narrows fp32 to FP8 wrongly (see
``fp8_gemv_triton``), so the CPU tests use rows FP8 holds exactly; rounding is checked on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.fp8 import FP8_DTYPE, FP8_MAX

_BLOCK_K = 2048  # elements of a row a program holds at once: two passes over K in these steps


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, scale_ptr, K, s_xm, s_xk, s_qm, FP8_LIMIT: tl.constexpr,
                          DYNAMIC: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * s_xm
    if DYNAMIC:
        amax = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(x_row + offs * s_xk, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        top = tl.max(amax, axis=0)
        scale = tl.where(top > 0, tl.math.div_rn(top, FP8_LIMIT), 1.0)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr).to(tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(x_row + offs * s_xk, mask=mask, other=0.0).to(tl.float32)
        # div_rn: Triton's `/` is the approximate div.full.f32, which puts quotients near an FP8 rounding
        # boundary on the other side of it now and then; torch's (and _scaled_mm users') division is IEEE
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_LIMIT), FP8_LIMIT)
        tl.store(q_ptr + row * s_qm + offs, q.to(tl.float8e4nv), mask=mask)


def quantize_fp8_triton(x: Tensor, input_scale: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(quantize_fp8(x, input_scale), input_scale)`` with a static scale, or
    ``quantize_fp8_rows(x)`` without one, in one launch; any strides; no host sync.

    Arguments:
        x: (M, K) fp32, bf16 or fp16.
        input_scale: a one-element float tensor on x's device, or None for a scale per row.

    Returns:
        q: (M, K) float8_e4m3fn, row-major; scale: the 0-dim float32 ``input_scale``, or (M, 1)
        float32 per-row scales (``amax / 448``; 1.0 for an all-zero row).
    """
    if x.dim() != 2:
        raise ValueError(f"x must be (M, K), got {tuple(x.shape)}")
    if input_scale is not None and input_scale.numel() != 1:
        raise ValueError(f"input_scale must hold one value, got shape {tuple(input_scale.shape)}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    if input_scale is None:
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    else:
        scale = input_scale.to(torch.float32).reshape(())
    if m and k:
        block_k = min(_BLOCK_K, triton.next_power_of_2(k))
        _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), x.stride(1), q.stride(0), FP8_LIMIT=FP8_MAX,
                                    DYNAMIC=input_scale is None, BLOCK_K=block_k, num_warps=4 if block_k >= 1024 else 1)
    elif input_scale is None:
        scale.fill_(1.0)
    return q, scale
