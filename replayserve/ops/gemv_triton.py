"""One-row linear (GEMV) in Triton: ``gemv_ref`` (``gemv.py``), ``y = x W^T + b`` for a single token,
the decode step at batch 1.

At one row cuBLAS picks split-K kernels plus a reduction kernel for the narrow projections and
reaches 2.2-3.1 TB/s; this kernel streams W once in (BLOCK_N, BLOCK_K) tiles, accumulating
products in fp32, and reaches 2.6-4.1 TB/s on the same shapes. H100, bf16, in a CUDA graph,
2026-12-05 (microseconds, cuBLAS / this kernel; the study `python benchmarks/bench_gemv.py`
repeats, not yet run itself): Nemotron-3-Nano in_proj
2688x10304 23.0 / 21.0, out_proj 4096x2688 9.0 / 5.4, qkv 2688x4608 7.9 / 5.8, LM head 2688x131072
248 / 227; Nemotron-H-8B in_proj 4096x18560 60.8 / 51.8, up 62.9 / 59.7, down 64.4 / 60.6 (with
the first tiles, and one weight called again and again: weights that fit in L2, as out_proj's 22
MB, were read from it, hence rates above the copy bandwidth; `bench_gemv.py` now cycles copies
beyond L2, and ``gemv_tiles`` has the H200 sweep). At four rows it lost everywhere (it rereads W
per row), so ``gemv.linear`` takes it for one row only.

``gemv_conv_triton`` is the same pass with the Mamba2 conv update in its epilogue, on the conv's
columns of the in_proj output: a batch-1 decode step's in_proj and conv in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.conv1d_triton import _conv_output, _store_window


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, s_x, s_wn, s_wk,
                 st_ptr, slot_ptr, cw_ptr, cb_ptr, conv_start, conv_dim, s_st_slot, s_st_d, s_st_k, s_cw_d, s_cw_k,
                 HAS_BIAS: tl.constexpr, HAS_CONV: tl.constexpr, HAS_CONV_BIAS: tl.constexpr,
                 CONV_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_U: tl.constexpr):
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
    y = y.to(y_ptr.dtype.element_ty)
    if HAS_CONV:
        _conv_epilogue(y, y_ptr + offs_n, offs_n - conv_start, mask_n, conv_dim, st_ptr, slot_ptr, cw_ptr, cb_ptr,
                       s_st_slot, s_st_d, s_st_k, s_cw_d, s_cw_k, HAS_CONV_BIAS, CONV_K, BLOCK_U)
    else:
        tl.store(y_ptr + offs_n, y, mask=mask_n)


@triton.jit
def _conv_epilogue(y, y_ptrs, c, mask_n, conv_dim, st_ptr, slot_ptr, cw_ptr, cb_ptr, s_st_slot, s_st_d, s_st_k,
                   s_cw_d, s_cw_k, HAS_CONV_BIAS: tl.constexpr, CONV_K: tl.constexpr, BLOCK_U: tl.constexpr):
    """Stores y (BLOCK_N,) at y_ptrs, then runs the conv decode step (``conv1d_triton``'s taps and
    state shift, silu) on its columns c in [0, conv_dim), reading the projection back as stored,
    and stores the conv's output over them. A negative slot (padding) gives zero conv columns and
    leaves the state alone."""
    slot = tl.load(slot_ptr).to(tl.int64)
    in_conv = mask_n & (c >= 0) & (c < conv_dim)
    live = in_conv & (slot >= 0)
    tl.store(y_ptrs, y, mask=mask_n)
    tl.debug_barrier()  # the projection is stored before any thread reads it back as the conv's input
    st_row = st_ptr + slot * s_st_slot + c.to(tl.int64) * s_st_d
    acc = _conv_output(st_row, y_ptrs, cw_ptr + c * s_cw_d, cb_ptr, c, 0, s_st_k, 0, s_cw_k, live, CONV_K,
                       HAS_CONV_BIAS, True)
    # The new state is u[1 : K]: read before its barrier, written after; y is read before it too.
    _store_window(st_row, y_ptrs, st_row, 1, s_st_k, 0, s_st_k, live, CONV_K, CONV_K - 1, BLOCK_U)
    tl.store(y_ptrs, tl.where(live, acc, 0.0).to(y.dtype), mask=in_conv)


def gemv_tiles(k: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a K-column weight, from an H200 sweep of 158 tilings
    (`python benchmarks/bench_gemv.py --sweep`: bf16, in a CUDA graph, weights cycled through copies
    larger than L2; 2026-12-06). Microseconds, the 4 x 512 x 4-warp tiles this replaced -> these
    (best of the sweep): Nemotron-3-Nano in_proj 2688x10304 16.4 -> 16.2 (15.4), qkv 2688x4608
    9.2 -> 9.1 (9.0), LM head 2688x131072 167 -> 161 (159), out_proj 4096x2688 9.1 -> 8.0 (7.9).
    Fewer rows per program spread a short K over more SMs. K from 16384 (Nemotron-H-8B's down
    projection) keeps the tiles measured on the H100."""
    if k >= 16384:
        return 4, 1024, 4
    if k >= 4096:
        return 2, 1024, 4
    return 2, 512, 2


def gemv_triton(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``gemv_ref`` in one launch; any strides. The grid depends on shapes only (CUDA-graph safe).

    Tiles by K (``gemv_tiles``).
    """
    if x.dim() != 2 or x.shape[0] != 1:
        raise ValueError(f"x must be (1, K), got {tuple(x.shape)}")
    n, k = weight.shape
    if x.shape[1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)} and bias "
                         f"{None if bias is None else tuple(bias.shape)} do not match")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_tiles(k)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias, y, n, k, x.stride(1), weight.stride(0), weight.stride(1),
        *(None,) * 4, 0, 0, 0, 0, 0, 0, 0,
        HAS_BIAS=bias is not None, HAS_CONV=False, HAS_CONV_BIAS=False, CONV_K=2, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_U=1, num_warps=warps)
    return y


def gemv_conv_triton(x: Tensor, weight: Tensor, bias: Tensor | None, conv_start: int, conv_state: Tensor,
                     conv_weight: Tensor, conv_bias: Tensor | None, slot: Tensor) -> Tensor:
    """``gemv_triton`` whose output columns [conv_start, conv_start + D) then take one decode step
    of the depthwise causal conv with silu (``causal_conv1d_update_ref``), in the same launch: the
    Mamba2 in_proj and conv update of a batch-1 decode step. The conv reads the projection as stored
    (rounded to x's dtype), as the two-launch path does.

    Arguments:
        x: (1, K); weight: (N, K); bias: (N,) or None.
        conv_start: first column of the conv's D channels (0 <= conv_start, conv_start + D <= N).
        conv_state: (S, D, W-1) pool of conv states; row ``slot`` is shifted in place.
        conv_weight: (D, W) depthwise taps; conv_bias: (D,) or None.
        slot: (1,) int32/int64 state slot; negative (padding) gives zero conv columns and leaves the
            pool untouched.

    Returns:
        (1, N) in x.dtype.
    """
    n = weight.shape[0]
    dim, width = conv_weight.shape
    if width < 2 or conv_state.shape[1:] != (dim, width - 1) or not 0 <= conv_start <= n - dim:
        raise ValueError(f"conv weight {tuple(conv_weight.shape)}, state {tuple(conv_state.shape)} and conv_start "
                         f"{conv_start} do not fit an output of {n} columns")
    if slot.shape != (1,) or (conv_bias is not None and conv_bias.shape != (dim,)):
        raise ValueError(f"slot must be (1,) and conv_bias ({dim},), got {tuple(slot.shape)} and "
                         f"{None if conv_bias is None else tuple(conv_bias.shape)}")
    if x.dim() != 2 or x.shape[0] != 1 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} must be (1, {weight.shape[1]})")
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_tiles(weight.shape[1])
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias, y, n, weight.shape[1], x.stride(1), weight.stride(0), weight.stride(1),
        conv_state, slot, conv_weight, conv_bias, conv_start, dim, *conv_state.stride(), *conv_weight.stride(),
        HAS_BIAS=bias is not None, HAS_CONV=True, HAS_CONV_BIAS=conv_bias is not None, CONV_K=width,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_U=triton.next_power_of_2(width - 1), num_warps=warps)
    return y
