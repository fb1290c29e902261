"""FP8 x FP8 GEMM through ``torch._scaled_mm`` (cuBLASLt / CUTLASS on Hopper): the prefill and
large-batch path of an FP8 Linear. The activations are quantized to FP8 with the checkpoint's static
``input_scale`` (per-tensor scaling), or, without one, with a dynamic scale per row (row-wise
scaling: each token's own ``amax / 448``, as vLLM's dynamic FP8 does), multiplied by the FP8 weight
with the scales applied in the epilogue, and written in 16-bit. On CUDA the quantization is one
Triton launch (``fp8_quant_triton``); elsewhere the plain-PyTorch references.

``torch._scaled_mm`` (torch 2.13) asks: ``mat1`` (M, K) row-major and ``mat2`` (K, N) column-major,
both float8; K and N multiples of 16 (M is free); per-tensor scales as one-element float32 tensors,
or row-wise ones as (M, 1) and (1, N) float32, contiguous (bf16 output on CUDA); a bias in the output
dtype, bf16 or fp16 (CUTLASS's row-wise kernel takes it; cuBLASLt's per-tensor one refuses it at some
shapes and for an fp32 output, so it is added after there). A
checkpoint's weight is (N, K) row-major, so ``weight.t()`` is the column-major ``mat2`` with no copy.
Shapes it refuses go to the dequantizing path (``scaled_mm_fits`` says which). Nothing here reads a
tensor back to the host, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.fp8 import FP8_DTYPE, fp8_scale, quantize_fp8, quantize_fp8_rows

SCALED_MM_MULTIPLE = 16  # cuBLASLt's FP8 GEMMs need K and N in multiples of 16


def scaled_mm_fits(weight: Tensor) -> bool:
    """Whether ``fp8_scaled_mm`` takes this (N, K) weight: float8_e4m3fn, row-major, K and N
    multiples of 16."""
    n, k = weight.shape
    return (weight.dtype == FP8_DTYPE and weight.stride(1) == 1 and n % SCALED_MM_MULTIPLE == 0
            and k % SCALED_MM_MULTIPLE == 0)


def row_wise_weight_scale(weight_scale: Tensor, n: int) -> Tensor:
    """The per-tensor ``weight_scale`` (one element) as the (1, N) contiguous float32 ``scale_b`` of
    row-wise scaling (``_scaled_mm`` refuses a stride-0 expand)."""
    return weight_scale.to(torch.float32).reshape(1, 1).expand(1, n).contiguous()


def fp8_scaled_mm(x: Tensor, weight: Tensor, weight_scale: Tensor, input_scale: Tensor | None = None,
                  bias: Tensor | None = None, out_dtype: torch.dtype | None = None,
                  weight_scale_rows: Tensor | None = None) -> Tensor:
    """``fp8_linear_ref(x, weight, weight_scale, input_scale, bias)`` as one FP8 GEMM; without an
    ``input_scale``, the activations are quantized per row (``quantize_fp8_rows``), or per tensor
    (``fp8_scale``) for a CUDA output other than bf16 (CUDA's row-wise scaling writes bf16 only).

    Arguments:
        x: (..., K) bf16, fp16 or fp32 activations.
        weight: (N, K) float8_e4m3fn, row-major; ``scaled_mm_fits(weight)`` must hold.
        weight_scale, input_scale: one-element float32 per-tensor scales on x's device.
        bias: (N,) or None; added in ``out_dtype``, in the epilogue under row-wise scaling.
        out_dtype: the result's dtype; x.dtype when None.
        weight_scale_rows: ``row_wise_weight_scale(weight_scale, N)``, kept by a caller that runs
            this repeatedly (``FP8Linear``: made once at load); None builds it here when needed.

    Returns:
        (..., N) in ``out_dtype``.
    """
    if not scaled_mm_fits(weight):
        raise ValueError(f"fp8_scaled_mm needs a row-major float8_e4m3fn weight with both dimensions multiples of "
                         f"{SCALED_MM_MULTIPLE}; got {tuple(weight.shape)} {weight.dtype} with strides "
                         f"{weight.stride()}: use the dequantizing path (fp8_linear_ref) for it")
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {(n, k)} and bias {None if bias is None else tuple(bias.shape)} "
                         "do not match")
    out_dtype = out_dtype or x.dtype
    rows = x.reshape(-1, k)
    row_wise = input_scale is None and (out_dtype == torch.bfloat16 or not x.is_cuda)
    if row_wise:
        q, scale_a = _quantize(rows, None)
        scale_b = row_wise_weight_scale(weight_scale, n) if weight_scale_rows is None else weight_scale_rows
    else:
        q, scale_a = _quantize(rows, fp8_scale(rows) if input_scale is None else input_scale)
        scale_b = weight_scale.to(torch.float32).reshape(())
    # CUTLASS's row-wise kernel adds a 16-bit bias in its epilogue; cuBLASLt's per-tensor FP8 GEMM
    # refuses one at some shapes (CUBLAS_STATUS_NOT_SUPPORTED on an H100 at 10 x 64 x 128), so it is added after
    epilogue_bias = bias is not None and row_wise and out_dtype in (torch.bfloat16, torch.float16)
    y = torch._scaled_mm(q, weight.t(), scale_a=scale_a, scale_b=scale_b,
                         bias=bias.to(out_dtype) if epilogue_bias else None, out_dtype=out_dtype)
    if bias is not None and not epilogue_bias:
        y = y + bias.to(out_dtype)
    return y.reshape(*x.shape[:-1], n)


def _quantize(rows: Tensor, input_scale: Tensor | None) -> tuple[Tensor, Tensor]:
    """(FP8 codes, scale_a) of the (M, K) activations: the Triton launch where kernels serve, else the
    references. A static scale comes back as a 0-dim float32 tensor, dynamic ones as (M, 1)."""
    if use_triton(rows) and rows.is_cuda:
        from replayserve.ops.fp8_quant_triton import quantize_fp8_triton

        return quantize_fp8_triton(rows, input_scale)
    if input_scale is None:
        return quantize_fp8_rows(rows)
    scale = input_scale.to(torch.float32).reshape(())
    return quantize_fp8(rows, scale).contiguous(), scale
