"""FP8 (e4m3) per-tensor quantization, as NVIDIA ModelOpt's ``FP8`` checkpoints store it, in plain PyTorch.

A quantized tensor is ``q = fp8(clamp(x / scale, -448, 448))`` with one float32 ``scale`` for the
whole tensor, and stands for ``q * scale``. ModelOpt sets a weight's scale to ``amax / 448`` (its
largest magnitude lands on the largest e4m3 value) and an activation's ``input_scale`` to the
calibrated ``amax / 448`` of the Linear's input; the KV cache's ``k_scale``/``v_scale`` are the same
kind of scale for the keys and values a layer stores. These are the references the FP8 kernels
(``fp8_gemm.py``, ``fp8_gemv_triton.py``) and the checkpoint tools are checked against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0: e4m3fn has no infinities; its largest finite value
# Rows of x one FP8 GEMV launch takes (fp8_gemv_triton).
FP8_GEMV_MAX_ROWS = 8
# Rows fp8_linear sends to the GEMV; more go to fp8_scaled_mm. On the H100 (bench_fp8_gemv.py,
# 2026-12-07) the GEMV wins at one row (35-39 us against _scaled_mm's 42-46 on the 8B shape's
# projections) but takes 3-6x _scaled_mm's time at 4 and 8 rows.
FP8_GEMV_DISPATCH_ROWS = 1


def _wide(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (the tests' exact arithmetic); everything else computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def fp8_scale(x: Tensor) -> Tensor:
    """The per-tensor scale that maps ``x``'s largest magnitude onto ``FP8_MAX``: ``amax / 448``,
    a 0-dim float32 tensor on x's device (no host sync). An all-zero tensor gets 1.0: any positive
    scale stores zeros exactly, and a zero scale would divide by zero."""
    amax = x.detach().abs().amax().to(torch.float32)
    return torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))


def quantize_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """``x / scale`` rounded to float8_e4m3fn (round to nearest even), saturating at +-448 rather
    than turning into NaN. x: any shape and float dtype; scale: a 0-dim or one-element tensor.
    Returns x's shape in float8_e4m3fn. NaN stays NaN."""
    wide = _wide(x.dtype)
    scaled = x.to(wide) / scale.to(wide).reshape(())
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_fp8_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """Dynamic per-row (per-token) quantization: each row of the (M, K) ``x`` with its own
    ``amax / 448`` (1.0 for an all-zero row). Returns ((M, K) float8_e4m3fn, (M, 1) float32 scales);
    row m stands for ``q[m] * scale[m]``. The reference of ``fp8_quant_triton``'s dynamic path."""
    wide = _wide(x.dtype)
    amax = x.detach().to(wide).abs().amax(dim=-1, keepdim=True)
    # divided by a tensor on amax's device: torch multiplies by the reciprocal when the divisor is a
    # Python number on CUDA (one ulp off the IEEE quotient the Triton kernel's div_rn computes)
    scale = torch.where(amax > 0, amax / amax.new_tensor(FP8_MAX), torch.ones_like(amax)).to(torch.float32)
    return (x.to(wide) / scale.to(wide)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``q * scale`` in ``dtype``: the values an FP8 tensor stands for. q: float8_e4m3fn, any
    shape; scale: 0-dim or one-element. The product is formed in float32 (float64 for a float64
    ``dtype``) and then cast, so a bfloat16 result is rounded once."""
    wide = _wide(dtype)
    return (q.to(wide) * scale.to(wide).reshape(())).to(dtype)


def quantize_fp8_per_tensor(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(quantize_fp8(x, s), s)`` with ``s = fp8_scale(x)``: what ModelOpt stores for a weight."""
    scale = fp8_scale(x)
    return quantize_fp8(x, scale), scale


def fp8_linear_ref(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None,
                   bias: Tensor | None = None) -> Tensor:
    """What a ModelOpt FP8 Linear computes, in exact-ish arithmetic: ``x_q @ W^T + b`` with
    ``W = dequantize_fp8(weight, weight_scale)`` and, with a static ``input_scale``, the activations
    rounded through FP8 first: ``x_q = dequantize_fp8(quantize_fp8(x, input_scale), input_scale)``.
    With ``input_scale=None`` x is used as it is (FP8 weights, 16-bit activations: what the FP8
    GEMV computes without an input scale). Dynamic activation quantization is this function with
    ``input_scale=fp8_scale(x)``.

    x: (..., K) float; weight: (N, K) float8_e4m3fn; weight_scale, input_scale: 0-dim or
    one-element float; bias: (N,) or None. Returns (..., N) in x.dtype, computed in float64 for
    float64 x and in float32 otherwise.
    """
    if weight.dtype != FP8_DTYPE:
        raise ValueError(f"weight must be {FP8_DTYPE}, got {weight.dtype}")
    wide = _wide(x.dtype)
    xw = x.to(wide) if input_scale is None else dequantize_fp8(quantize_fp8(x, input_scale), input_scale, wide)
    y = xw @ dequantize_fp8(weight, weight_scale, wide).t()
    if bias is not None:
        y = y + bias.to(wide)
    return y.to(x.dtype)


def requantize_to_max_scale(weights: Sequence[Tensor], scales: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """One FP8 tensor with one scale for a fused projection whose shards were quantized apart
    (q/k/v into qkv, or the shards of a merged column Linear): each shard is dequantized and
    requantized with the largest of the scales, then the shards are stacked along dim 0. Dividing
    by a larger scale only shrinks values, so nothing saturates; the shard(s) that already had the
    largest scale come back bit for bit, the others lose the low bits their finer scale held.

    weights: float8_e4m3fn tensors (N_i, K) with the same K; scales: one 0-dim or one-element float
    scale per shard. Returns ((sum N_i, K) float8_e4m3fn, 0-dim float32 scale).
    """
    if len(weights) != len(scales) or not weights:
        raise ValueError(f"need one scale per shard and at least one shard, got {len(weights)} weights "
                         f"and {len(scales)} scales")
    if any(w.dtype != FP8_DTYPE for w in weights):
        raise ValueError(f"every shard must be {FP8_DTYPE}, got {[w.dtype for w in weights]}")
    flat = [s.to(torch.float32).reshape(()) for s in scales]
    top = torch.stack(flat).amax()
    parts = [quantize_fp8(dequantize_fp8(w, s), top) for w, s in zip(weights, flat, strict=True)]
    return torch.cat(parts, dim=0), top
