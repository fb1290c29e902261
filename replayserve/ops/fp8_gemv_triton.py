"""FP8-weight GEMV in Triton: ``y = x W^T + b`` for the few rows of a decode step, W stored as
float8_e4m3fn with one per-tensor scale. It streams W once in (BLOCK_N, BLOCK_K) tiles, as the
bf16 ``gemv_triton`` does, so a decode step reads half the bytes; the FP8 values are widened to
fp32 in registers and every row of x in the tile is multiplied by the same W tile (it reads W once
for up to ``FP8_GEMV_MAX_ROWS`` rows, where the bf16 kernel rereads it per row). The weight scale
(and the input scale) multiply the fp32 sums once, at the end.

With an ``input_scale`` the activations are rounded through FP8 with it first, in registers, so
the result is the ModelOpt FP8 Linear of ``fp8_linear_ref`` (the same numbers as the
``_scaled_mm`` prefill path, up to summation order); without one they stay 16-bit (FP8 weights,
16-bit activations).

The Triton interpreter (3.7.1) widens FP8 exactly but narrows fp32 to FP8 wrongly: a value that
rounds up across a power of two lands in the binade below (127.9 -> 64, not 128), and ties round
up instead of to even. So on the CPU the input-scale path is checked only with activations that
FP8 holds exactly; rounding random activations is checked on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.fp8 import FP8_DTYPE, FP8_GEMV_MAX_ROWS, FP8_MAX
from replayserve.ops.gemv_triton import gemv_tiles


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym,
                     FP8_LIMIT: tl.constexpr, QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    mask_n = offs_n < N
    mask_m = offs_m < M
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * s_xm
    x_scale = 1.0
    if QUANT_X:
        x_scale = tl.load(xs_ptr).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :] * s_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_rows + offs_k[None, :] * s_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        x = x.to(tl.float32)
        if QUANT_X:
            # IEEE division (div_rn), as quantize_fp8: Triton's `/` (div.full.f32, within 2 ulp) rounds a
            # quotient near an FP8 boundary to the other code now and then (an H100 saw it in float16)
            x = tl.minimum(tl.maximum(tl.math.div_rn(x, x_scale), -FP8_LIMIT), FP8_LIMIT).to(tl.float8e4nv)
            x = x.to(tl.float32)
        acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    y = tl.sum(acc, axis=2) * (tl.load(ws_ptr).to(tl.float32) * x_scale)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def fp8_gemv_tiles(rows: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for ``rows`` rows of x and a K-column weight.

    One row: from an H100 sweep of 144 tilings (``python benchmarks/bench_fp8_gemv.py --sweep``, in a CUDA
    graph, weights cycled beyond L2; 2026-12-07), microseconds with the bf16 GEMV's tiles this replaced ->
    these: Nemotron-H-8B in_proj 4096x18560 50.9 -> 34.5, up 4096x21504 58.7 -> 39.4, down 21504x4096 50.5 ->
    39.3; Nemotron-3-Nano LM head 2688x131072 236 -> 149 (the best, 16 x 256, 142), in_proj 2688x10304 22.9 ->
    best 16.7 with 8-row tiles of 256 or 1024 columns. An FP8 tile is half a bf16 tile's bytes, so it takes more
    rows (8) of the weight per program. More rows keep the accumulator's size by narrowing BLOCK_K (unswept:
    ``fp8_linear`` sends them to ``_scaled_mm``)."""
    if rows == 1:
        return (1, 8, 1024, 4) if k >= 4096 else (1, 8, 512, 2)
    block_m = triton.next_power_of_2(rows)
    block_n, block_k, warps = gemv_tiles(k)
    return block_m, block_n, max(block_k // block_m, 64), warps


def fp8_gemv_triton(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None = None,
                    bias: Tensor | None = None) -> Tensor:
    """``fp8_linear_ref(x, weight, weight_scale, input_scale, bias)`` in one launch; any strides.
    The grid depends on shapes only and the scales are read on the device (CUDA-graph safe).

    Arguments:
        x: (M, K) fp32, bf16 or fp16 with 1 <= M <= ``FP8_GEMV_MAX_ROWS``.
        weight: (N, K) float8_e4m3fn.
        weight_scale, input_scale: one-element float tensors on x's device; input_scale None keeps
            x unrounded.
        bias: (N,) or None.

    Returns:
        (M, N) in x.dtype.
    """
    if x.dim() != 2 or not 1 <= x.shape[0] <= FP8_GEMV_MAX_ROWS:
        raise ValueError(f"x must be (M, K) with 1 <= M <= {FP8_GEMV_MAX_ROWS}, got {tuple(x.shape)}")
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    n, k = weight.shape
    if x.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    scales = [s for s in (weight_scale, input_scale) if s is not None]
    if any(s.numel() != 1 for s in scales):
        raise ValueError(f"weight_scale and input_scale must hold one value each, got shapes "
                         f"{[tuple(s.shape) for s in scales]}")
    rows = x.shape[0]
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    block_m, block_n, block_k, warps = fp8_gemv_tiles(rows, k)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight_scale, input_scale, bias, y, rows, n, k, x.stride(0), x.stride(1), weight.stride(0),
        weight.stride(1), y.stride(0), FP8_LIMIT=FP8_MAX, QUANT_X=input_scale is not None, HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return y
