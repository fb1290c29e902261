"""Row gather-scatter between slot pools: ``dst[dst_index[m]] = src[src_index[m]]`` for every m.

Prefix caching copies whole per-slot states this way (``SSMBackend.copy_slots``: a hit's cached
state into a live slot, a decode row's state into the boundary slot that caches it): rows of
4 MiB per layer at Nemotron-H-8B's shape. PyTorch's ``dst[i] = src[j]`` gathers into a temporary
and then runs the advanced-indexing put, reading and writing every byte twice; ``copy_rows_triton``
reads each source row once and writes it once. (Prefill's captures, which it used to move, are
now written by the packed prefill kernels themselves.)
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.dtypes import triton_ok


def copy_rows_ref(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """src: (S, ...) and dst: (S', ...) with the same row shape; src_index, dst_index: (M,) int64.
    Rows dst[dst_index] are overwritten IN PLACE with src[src_index] in dst's dtype. dst_index
    must be distinct; a row may be both read and written only if it is the same row (m's own)."""
    dst[dst_index] = src[src_index].to(dst.dtype)


@triton.jit
def _copy_rows_kernel(src_ptr, src_idx_ptr, dst_ptr, dst_idx_ptr, row_elems, s_src, s_dst, BLOCK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < row_elems
    src_row = tl.load(src_idx_ptr + m).to(tl.int64)
    dst_row = tl.load(dst_idx_ptr + m).to(tl.int64)
    values = tl.load(src_ptr + src_row * s_src + offs, mask=mask)
    tl.store(dst_ptr + dst_row * s_dst + offs, values.to(dst_ptr.dtype.element_ty), mask=mask)


def copy_rows_triton(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """``copy_rows_ref`` in one launch, for pools whose rows are contiguous (each slot one run of
    memory). No host sync: the grid depends on shapes only."""
    if src.shape[1:] != dst.shape[1:]:
        raise ValueError(f"row shapes differ: src {tuple(src.shape)}, dst {tuple(dst.shape)}")
    if src_index.shape != dst_index.shape or src_index.dim() != 1:
        raise ValueError(f"indices must be (M,) alike, got {tuple(src_index.shape)} and {tuple(dst_index.shape)}")
    if not (src[0].is_contiguous() and dst[0].is_contiguous()):
        raise ValueError("copy_rows_triton needs contiguous rows")
    rows, row_elems = src_index.shape[0], src[0].numel()
    if rows == 0:
        return
    _copy_rows_kernel[(rows, triton.cdiv(row_elems, BLOCK))](
        src, src_index, dst, dst_index, row_elems, src.stride(0), dst.stride(0), BLOCK=BLOCK, num_warps=8)


BLOCK = 4096  # elements per program: 16 KiB of fp32 state, 8 warps of 16-byte accesses


def copy_rows(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """The kernel where it serves the pools (CUDA, float dtypes, contiguous rows), else the ref."""
    if triton_ok(src) and triton_ok(dst) and src[0].is_contiguous() and dst[0].is_contiguous():
        copy_rows_triton(src, src_index, dst, dst_index)
    else:
        copy_rows_ref(src, src_index, dst, dst_index)
