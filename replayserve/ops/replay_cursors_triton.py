"""Triton ReplaySSM cursor kernels: match ``replay_prepare_ref`` and ``replay_commit_ref`` in
``replayserve.ops.replay_ssm``. One program covers up to 1024 rows; cursors are shared by every
Mamba layer of a cache group, so these run once per step, not once per layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


# `rows` (the step's decode rows) is not specialised on (== 1, divisible by 16): BLOCK already
# follows it, and an eager step of any row count then reuses the variant of its graph bucket.
@triton.jit(do_not_specialize=["rows"])
def _replay_prepare_kernel(rs_ptr, hist_ptr, flush_ptr, slots_ptr, ntok_ptr, fresh_ptr, rows, window,
                           BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + offs, mask=offs < rows, other=-1)
    real = slot >= 0
    safe = tl.where(real, slot, 0)
    fresh = tl.load(fresh_ptr + offs, mask=real, other=0) != 0
    tl.store(rs_ptr + safe, tl.zeros_like(safe).to(tl.int32), mask=real & fresh)
    tl.store(hist_ptr + safe, tl.zeros_like(safe).to(tl.int32), mask=real & fresh)
    m = tl.where(fresh, 0, tl.load(hist_ptr + safe, mask=real, other=0))
    n = tl.load(ntok_ptr + offs, mask=real, other=0)
    tl.store(flush_ptr + safe, (m + n > window).to(tl.uint8), mask=real)


@triton.jit(do_not_specialize=["rows"])
def _replay_commit_kernel(rs_ptr, hist_ptr, flush_ptr, slots_ptr, nacc_ptr, rows, R, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    slot = tl.load(slots_ptr + offs, mask=offs < rows, other=-1)
    acc = tl.load(nacc_ptr + offs, mask=offs < rows, other=0)
    live = (slot >= 0) & (acc != 0)
    safe = tl.where(live, slot, 0)
    acc = tl.maximum(acc, 1)
    m = tl.load(hist_ptr + safe, mask=live, other=0)
    start = tl.load(rs_ptr + safe, mask=live, other=0)
    flush = tl.load(flush_ptr + safe, mask=live, other=0) != 0
    moved = start + m
    moved = tl.where(moved >= R, moved - R, moved)
    tl.store(rs_ptr + safe, moved, mask=live & flush)
    tl.store(hist_ptr + safe, tl.where(flush, acc, m + acc), mask=live)


def flag_bytes(t: Tensor) -> Tensor:
    """A bool tensor as uint8 (same storage), so kernels read and write plain bytes."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def replay_prepare_triton(
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor, fresh: Tensor,
    window: int,
) -> None:
    """Before a step: reset fresh rows' cursors, then recompute ``is_flush = history + n > window``.

    Arguments:
        ring_start, history: (S,) int32 cursors, updated in place for fresh rows.
        is_flush: (S,) bool, written for every real row.
        slots: (rows,) int64, -1 = padded row (skipped).
        num_tokens: (rows,) int32 tokens this step, in [1, T].
        fresh: (rows,) bool, True where the row's slot starts from a canonical state.
        window: W = R - T.
    """
    rows = slots.shape[0]
    if rows == 0:
        return
    block = min(1024, triton.next_power_of_2(rows))
    _replay_prepare_kernel[(triton.cdiv(rows, block),)](
        ring_start, history, flag_bytes(is_flush), slots, num_tokens, flag_bytes(fresh), rows, window, BLOCK=block)


def replay_commit_triton(
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_accepted: Tensor, ring_len: int,
) -> None:
    """After sampling: ``a = max(num_accepted, 1)``; flush rows move the origin past the folded
    history (``ring_start += history mod R``) and keep ``history = a``, others ``history += a``.

    Arguments:
        ring_start, history: (S,) int32, updated in place.
        is_flush: (S,) bool, read only.
        slots: (rows,) int64, -1 = padded row (skipped).
        num_accepted: (rows,) int32; 0 = held a slot but ran nothing (skipped).
        ring_len: R.
    """
    rows = slots.shape[0]
    if rows == 0:
        return
    block = min(1024, triton.next_power_of_2(rows))
    _replay_commit_kernel[(triton.cdiv(rows, block),)](
        ring_start, history, flag_bytes(is_flush), slots, num_accepted, rows, ring_len, BLOCK=block)
