"""Row gather-scatter between slot pools: ``dst[dst_index[m]] = src[src_index[m]]`` for every m.

Prefix caching copies whole per-slot states this way (``SSMBackend.copy_slots``: a hit's cached
state into a live slot, a decode row's state into the boundary slot that caches it): rows of
4 MiB per layer at Nemotron-H-8B's shape. PyTorch's ``dst[i] = src[j]`` gathers into a temporary
and then runs the advanced-indexing put, reading and writing every byte twice; ``copy_rows_triton``
reads each source row once and writes it once. (Prefill's captures, which it used to move, are
now written by the packed prefill kernels themselves.)
"""

from __future__ import annotations

from torch import Tensor

from replayserve.ops.dispatch import use_triton


def copy_rows_ref(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """src: (S, ...) and dst: (S', ...) with the same row shape; src_index, dst_index: (M,) int64.
    Rows dst[dst_index] are overwritten IN PLACE with src[src_index] in dst's dtype. dst_index
    must be distinct; a row may be both read and written only if it is the same row (m's own)."""
    dst[dst_index] = src[src_index].to(dst.dtype)


def copy_rows(src: Tensor, src_index: Tensor, dst: Tensor, dst_index: Tensor) -> None:
    """The kernel where it serves the pools (CUDA, float dtypes, contiguous rows), else the ref."""
    if use_triton(src) and use_triton(dst) and src[0].is_contiguous() and dst[0].is_contiguous():
        from replayserve.ops.copy_rows_triton import copy_rows_triton  # Triton only where the kernel runs

        copy_rows_triton(src, src_index, dst, dst_index)
    else:
        copy_rows_ref(src, src_index, dst, dst_index)
