"""FP8-weight GEMV in Triton: ``y = x W^T + b`` for the few rows of a decode step, W stored as
float8_e4m3fn with one per-tensor scale. It streams W once in (BLOCK_N, BLOCK_K) tiles, as the
bf16 ``gemv_triton`` does, so a decode step reads half the bytes; the FP8 values are widened to
fp32 in registers and every row of x in the tile is multiplied by the same W tile (it reads W once
for up to ``FP8_GEMV_MAX_ROWS`` rows, where the bf16 kernel rereads it per row). The weight scale
(and the input scale) multiply the fp32 sums once, at the end.

Widening: FP8 -> fp32 by conversion instructions takes 1.5 of them per weight (e4m3x2 -> f16x2, then
f16 -> f32), and sm_90 issues 16 conversions a clock per SM: about 10.7 weights (bytes) a clock, under
the ~12.7 a clock per SM that an H100's copy bandwidth delivers. An H100 sweep of those tiles topped
out at 75% of copy bandwidth (8B in_proj: 34.5 us), the bf16 GEMV at 92%. So where the weight's
rows are 4-byte aligned (``packed_words``) the kernel reads int32 words of 4 weights and widens each
byte with three integer ops into an fp32 that is its value times 2^-120 (``_widen_byte``); x is
scaled by 2^64 and the sums by 2^56 to match. Measured on an H100 (2026-12-08) it did not pay as a
default: the 8B shape's FP8 step went from 247 to 222 tok/s (its x, loaded at a stride of 4 per
byte plane, is re-laid through shared memory each K step: 37 barriers a step against 4), while
with an input scale (whose per-element division costs both paths alike) it ran 8B down 46 against
61 us, in_proj and up as before. So it is an option (``packed=True``) for further work.

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

# 2^64 and 2^56: the packed path's widened weights are w * 2^-120 (``_widen_byte``), so it multiplies x by
# 2^64 and the sums by 2^56: powers of two, exact unless |x| >= 2^64 or a product |w x| < 2^-70 lands
# in fp32's subnormals (1e-21 of an activation: below any bf16 output's rounding).
X_SHIFT = tl.constexpr(2.0**64)
Y_SHIFT = tl.constexpr(2.0**56)
# 0x87F00000 as an int32: the sign bit and the 7 bits of exponent and mantissa, placed as ``_widen_byte`` says.
_FP32_FIELDS = tl.constexpr(0x87F00000 - 2**32)


@triton.jit
def _widen_byte(words, J: tl.constexpr):
    """FP8 e4m3 byte J of each int32 word (little-endian: element 4 i + J) -> fp32 equal to its value
    times 2^-120, by integer ops only: the byte's sign goes to bit 31 and its 7 other bits (exponent,
    mantissa) to bits 20..26, i.e. an fp32 exponent field e and mantissa m/8 for the e4m3 fields e, m;
    fp32's bias (127) against e4m3's (7) makes it the value times 2^-120, subnormals (e = 0) included.
    The byte is shifted to the top, then arithmetically 4 to the right (the sign fills bits 27..31)."""
    if J < 3:
        words = words << (24 - 8 * J)
    return ((words >> 4) & _FP32_FIELDS).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, ws_ptr, xs_ptr, b_ptr, y_ptr, M, N, K, s_xm, s_xk, s_wn, s_wk, s_ym,
                     FP8_LIMIT: tl.constexpr, QUANT_X: tl.constexpr, HAS_BIAS: tl.constexpr, PACKED: tl.constexpr,
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
    if PACKED:  # w_ptr: int32 words of 4 FP8 weights (K, s_wn in words, s_wk 1); BLOCK_K words per step
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            words = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0)
            for j in tl.static_range(4):
                x = tl.load(x_rows + (4 * offs_k[None, :] + j) * s_xk, mask=mask_m[:, None] & mask_k[None, :],
                            other=0.0)
                x = _input(x, x_scale, FP8_LIMIT, QUANT_X) * X_SHIFT
                acc += _widen_byte(words, j)[None, :, :] * x[:, None, :]
        y = tl.sum(acc, axis=2) * (tl.load(ws_ptr).to(tl.float32) * x_scale * Y_SHIFT)
    else:  # FP8 loads widened by conversion instructions (cvt: 16 a clock per SM on sm_90)
        acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < K
            w = tl.load(w_rows + offs_k[None, :] * s_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            x = tl.load(x_rows + offs_k[None, :] * s_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
            acc += w.to(tl.float32)[None, :, :] * _input(x, x_scale, FP8_LIMIT, QUANT_X)[:, None, :]
        y = tl.sum(acc, axis=2) * (tl.load(ws_ptr).to(tl.float32) * x_scale)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _input(x, x_scale, FP8_LIMIT: tl.constexpr, QUANT_X: tl.constexpr):
    """x in fp32, rounded through FP8 with x_scale if QUANT_X (the ModelOpt FP8 Linear's input)."""
    x = x.to(tl.float32)
    if QUANT_X:
        # IEEE division (div_rn), as quantize_fp8: Triton's `/` (div.full.f32, within 2 ulp) rounds a
        # quotient near an FP8 boundary to the other code now and then (an H100 saw it in float16)
        x = tl.minimum(tl.maximum(tl.math.div_rn(x, x_scale), -FP8_LIMIT), FP8_LIMIT).to(tl.float8e4nv)
        x = x.to(tl.float32)
    return x


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
                    bias: Tensor | None = None, packed: bool | None = None) -> Tensor:
    """``fp8_linear_ref(x, weight, weight_scale, input_scale, bias)`` in one launch; any strides.
    The grid depends on shapes only and the scales are read on the device (CUDA-graph safe).

    Arguments:
        x: (M, K) fp32, bf16 or fp16 with 1 <= M <= ``FP8_GEMV_MAX_ROWS``.
        weight: (N, K) float8_e4m3fn.
        weight_scale, input_scale: one-element float tensors on x's device; input_scale None keeps
            x unrounded.
        bias: (N,) or None.
        packed: read the weight as int32 words of 4 FP8 values and widen them by integer ops
            (``_widen_byte``) rather than by FP8 conversion instructions (the module docstring says
            why). Off by default: on an H100 it made the 8B shape's FP8 decode step slower (222
            against 247 tok/s), though faster on a long-K projection (8B down, with an input scale).

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
    words = packed_words(weight) if packed else None
    if packed and words is None:
        raise ValueError(f"packed=True needs a weight of 4-byte-aligned rows of contiguous bytes, got strides "
                         f"{weight.stride()} and K={k}")
    w, kw, s_wn = (words, k // 4, words.stride(0)) if words is not None else (weight, k, weight.stride(0))
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, weight_scale, input_scale, bias, y, rows, n, kw, x.stride(0), x.stride(1), s_wn,
        weight.stride(1), y.stride(0), FP8_LIMIT=FP8_MAX, QUANT_X=input_scale is not None, HAS_BIAS=bias is not None,
        PACKED=words is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k // 4 if words is not None else block_k, num_warps=warps)
    return y


def packed_words(weight: Tensor) -> Tensor | None:
    """The (N, K) FP8 weight as (N, K / 4) int32 words (a view), or None where its rows are not runs of
    4-byte-aligned contiguous bytes (K % 4, a column stride, a row stride or offset not a multiple of 4)."""
    if (weight.shape[1] % 4 or weight.stride(1) != 1 or weight.stride(0) % 4 or weight.storage_offset() % 4
            or weight.untyped_storage().data_ptr() % 4):
        return None
    return weight.view(torch.int32)
