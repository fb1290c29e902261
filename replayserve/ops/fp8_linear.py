"""The FP8 Linear's entry point: which implementation computes ``fp8_linear_ref`` for a call.

A ModelOpt FP8 Linear (float8_e4m3fn weight, per-tensor ``weight_scale``, optional static
``input_scale``) runs, where the kernels serve (``dispatch.use_triton``: CUDA, 16/32-bit x):

- up to ``FP8_GEMV_DISPATCH_ROWS`` rows (a decode step at batch 1): ``fp8_gemv_triton``;
- more rows, when cuBLASLt takes the weight (``scaled_mm_fits``: N and K multiples of 16) and x
  is on CUDA: ``fp8_scaled_mm`` (``torch._scaled_mm``);
- everything else (the CPU, float64, odd shapes): ``fp8_linear_ref``, which dequantizes.

The choice reads shapes and dtypes only and every path reads its scales on the device, so a CUDA
graph can capture any of them.
"""

from __future__ import annotations

from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.fp8 import FP8_GEMV_DISPATCH_ROWS, fp8_linear_ref
from replayserve.ops.fp8_gemm import fp8_scaled_mm, scaled_mm_fits


def fp8_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None = None,
               bias: Tensor | None = None, weight_scale_rows: Tensor | None = None) -> Tensor:
    """``fp8_linear_ref(x, weight, weight_scale, input_scale, bias)`` by the fastest path that serves.

    x: (..., K) float; weight: (N, K) float8_e4m3fn; weight_scale, input_scale: 0-dim float32 on
    x's device (input_scale None: activations stay 16-bit on the GEMV and reference paths, and are
    scaled per call on the ``_scaled_mm`` path); bias: (N,) or None; weight_scale_rows: (1, N)
    float32, ``weight_scale`` repeated, which the ``_scaled_mm`` path's row-wise scaling reads
    (None: built there per call). Returns (..., N) in x.dtype.
    """
    k = x.shape[-1]
    rows = x.numel() // k if k else 0
    if use_triton(x) and 1 <= rows <= FP8_GEMV_DISPATCH_ROWS:
        from replayserve.ops.fp8_gemv_triton import fp8_gemv_triton

        y = fp8_gemv_triton(x.reshape(rows, k), weight, weight_scale, input_scale, bias)
        return y.reshape(*x.shape[:-1], weight.shape[0])
    if use_triton(x) and x.is_cuda and rows > 0 and scaled_mm_fits(weight):
        return fp8_scaled_mm(x, weight, weight_scale, input_scale, bias, weight_scale_rows=weight_scale_rows)
    return fp8_linear_ref(x, weight, weight_scale, input_scale, bias)
