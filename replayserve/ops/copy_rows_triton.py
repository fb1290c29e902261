"""``copy_rows_ref`` (``copy_rows.py``) as one Triton launch: each source row read once, written once."""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

BLOCK = 4096  # elements per program: 16 KiB of fp32 state, 8 warps of 16-byte accesses


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
