"""Triton alignment of the routed (token, k) pairs by expert, the grouped GEMM's input order.

``align_by_expert`` sorts the T * top_k pairs by expert (stably: by pair index within an expert)
and pads each expert's run to a multiple of BLOCK_M, in a buffer of the largest padded size the
shapes allow; padding entries hold T * top_k and are masked. One Triton program does it for
decode-sized batches; larger ones take a few sync-free PyTorch ops. Nothing reads a device value
on the host: CUDA-graph safe.

The routing kernels (``moe_route_triton``: Nemotron-H's sigmoid routing; ``moe_softmax_route_triton``:
Granite 4.0-H's and the Qwen MoEs' softmax routing) align their own ids in the same program for
decode steps: they call ``align_pairs`` after storing the ids, on buffers from ``alignment_buffers``
with the constants of ``align_meta``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

# At most this many (token, k) pairs are aligned by one program (decode steps: one launch instead
# of about 15); it walks the pairs in chunks, so larger batches take the PyTorch ops. Untuned.
ALIGN_IN_ONE_PROGRAM = 1024


# One program aligns the `num_pairs` int32 expert ids at ids_ptr into the three buffers of
# ``alignment_buffers`` (``align_by_expert``'s outputs); the routing kernels call it on their own ids.
@triton.jit
def align_pairs(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    # A block's expert is the number of experts whose padded run ends at or before the block starts.
    for b0 in range(0, num_blocks, BLOCK_N):
        b = b0 + tl.arange(0, BLOCK_N)
        owner = tl.sum((padded_end[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)
    for p0 in range(0, num_blocks * BLOCK_M, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        tl.store(sorted_ptr + p, tl.full([BLOCK_N], 0, tl.int32) + num_pairs, mask=p < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the padding is written before the pairs overwrite their places
    seen = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_N):
        offs = start + tl.arange(0, BLOCK_N)
        e = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        earlier = tl.cumsum(onehot, axis=0) - onehot  # pairs of this chunk before this one, same expert
        place = tl.sum(onehot * (earlier + (padded_start + seen)[None, :]), axis=1)
        tl.store(sorted_ptr + place, offs, mask=offs < num_pairs)
        seen += tl.sum(onehot, axis=0)


# Pair and block counts change every step: not specialised on them (a variant per kind of count
# mid-serving otherwise).
@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_blocks,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):
    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_pairs, num_blocks, BLOCK_M, BLOCK_E,
                BLOCK_N)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M-row blocks T * top_k = num_pairs pairs can need: each expert that gets a
    pair pads its run by fewer than block_m rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def alignment_buffers(num_pairs: int, num_experts: int, block_m: int, device: torch.device
                      ) -> tuple[Tensor, Tensor, Tensor]:
    """Uninitialised (sorted_pairs, block_expert, num_padded) as ``align_by_expert`` returns them,
    sized for `num_pairs` pairs over `num_experts` experts."""
    blocks = max_blocks(num_pairs, num_experts, block_m)
    return (torch.empty(blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device), torch.empty(1, dtype=torch.int32, device=device))


def align_meta(num_experts: int, block_m: int, num_pairs: int) -> dict:
    """BLOCK_N pairs (and blocks) a step: no more than the pairs, at most 8192 // BLOCK_E. H200,
    Nano's 8 pairs over 130 experts in the one-program route + align: 15.2 us a graph replay with 8
    pairs a step and 8 warps, against 24.2 us with 32 and 4 warps (2026-12-06)."""
    block_e = triton.next_power_of_2(num_experts)
    return dict(BLOCK_M=block_m, BLOCK_E=block_e,
                BLOCK_N=max(8, min(triton.next_power_of_2(num_pairs), 8192 // block_e)))


def align_by_expert(ids: Tensor, num_experts: int, block_m: int,
                    one_program: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, k) pairs grouped by expert in padded blocks, without a host sync.

    Arguments:
        ids: (T, top_k) integer expert ids in [0, E).
        num_experts: E.
        block_m: rows per block; each expert's run is padded to a multiple of it.
        one_program: the one-program Triton kernel (default: up to ALIGN_IN_ONE_PROGRAM pairs) or
            PyTorch ops.

    Returns:
        sorted_pairs: (max_blocks * block_m,) int32 pair indices t * top_k + k, by expert then
            pair; padding holds T * top_k.
        block_expert: (max_blocks,) int32, the expert of each block; blocks past num_padded hold
            any value and are skipped.
        num_padded: (1,) int32, the padded length in use.
    """
    flat = ids.reshape(-1).to(torch.int32)
    num_pairs, dev = flat.numel(), ids.device
    if one_program is None:
        one_program = num_pairs <= ALIGN_IN_ONE_PROGRAM
    if one_program:
        sorted_pairs, block_expert, num_padded = alignment_buffers(num_pairs, num_experts, block_m, dev)
        _align_kernel[(1,)](flat, sorted_pairs, block_expert, num_padded, num_pairs, block_expert.numel(),
                            **align_meta(num_experts, block_m, num_pairs), num_warps=4)
        return sorted_pairs, block_expert, num_padded
    blocks = max_blocks(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.long(), torch.ones(num_pairs, dtype=torch.int64, device=dev))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    by_expert, order = torch.sort(flat.long(), stable=True)
    rank = torch.arange(num_pairs, device=dev) - (counts.cumsum(0) - counts).gather(0, by_expert)
    place = (padded_end - padded).gather(0, by_expert) + rank
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, place, order.to(torch.int32))
    starts = torch.arange(blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert, padded_end[-1:].to(torch.int32)
