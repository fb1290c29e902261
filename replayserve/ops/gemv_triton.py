"""One-row linear (GEMV) in Triton: ``y = x W^T + b`` for a single token, the decode step at batch 1.

At one row cuBLAS picks split-K kernels plus a reduction kernel for the narrow projections and
reaches 2.2-3.1 TB/s; this kernel streams W once in (BLOCK_N, BLOCK_K) tiles, accumulating
products in fp32, and reaches 2.6-4.1 TB/s on the same shapes. H100, bf16, in a CUDA graph,
2026-12-05 (microseconds, cuBLAS / this kernel; the study `python benchmarks/bench_gemv.py`
repeats, not yet run itself): Nemotron-3-Nano in_proj
2688x10304 23.0 / 21.0, out_proj 4096x2688 9.0 / 5.4, qkv 2688x4608 7.9 / 5.8, LM head 2688x131072
248 / 227; Nemotron-H-8B in_proj 4096x18560 60.8 / 51.8, up 62.9 / 59.7, down 64.4 / 60.6. At four
rows it lost everywhere (it rereads W per row), so `layers/linear.Linear` takes it for one row only.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.dtypes import compute_dtype


def gemv_ref(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x: (1, K); weight: (N, K); bias: (N,) or None. Returns (1, N) in x.dtype, computed in
    ``compute_dtype`` (fp32 for half inputs)."""
    wide = compute_dtype(x.dtype)
    y = x.to(wide) @ weight.to(wide).t()
    if bias is not None:
        y = y + bias.to(wide)
    return y.to(x.dtype)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_x, s_wn, s_wk,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * s_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        w = tl.load(w_rows + offs_k[None, :] * s_wk, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        x = tl.load(x_ptr + offs_k * s_x, mask=mask_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gemv_ref`` in one launch; any strides. The grid depends on shapes only (CUDA-graph safe).

    Tiles: 4 output rows by 512 columns of K (1024 from K = 16384), 4 warps: the best or within a
    few percent of the best of 8 tilings on every shape in the module docstring.
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be (1, K), got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k = 4, (1024 if k >= 16384 else 512)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias, y, n, k, x.stride(1), weight.stride(0), weight.stride(1),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return y
