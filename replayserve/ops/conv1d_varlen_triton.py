"""Triton depthwise causal conv1d over packed variable-length sequences: matches
``replayserve.ops.conv1d.causal_conv1d_varlen_ref``.

Two launches. ``_conv1d_varlen_kernel``, one program per (channel block, token block) of the packed
tokens, looks up each token's sequence (a block may span several) and reads each tap either from
the packed inputs or, for the first K-1 tokens of a sequence, from the sequence's conv state slot
(cast to x's dtype first, as the reference does); taps are summed in fp32 in the reference's order,
then bias and SiLU. ``_conv_state_varlen_kernel``, one program per (channel block, sequence), then
writes the K-1 inputs ending at each sequence's last token into its slot. It runs after the first
launch in stream order, so no program of the first can read a state the second has overwritten.
Prefix caching's captures (the conv state at a boundary inside a sequence, into a boundary slot)
are one more launch of the same kernel before the others; a capture at a sequence's end is
stored by the final-state program beside the slot's own.

On an H200 (Triton 3.6, bf16, D 10240, K 4, 2026-12-04) 16 sequences of 1024 tokens took 0.73 ms
(0.92 TB/s; the per-sequence reference 6.6 ms) and one of 4096 tokens 0.22 ms (reference 1.6 ms).
Token blocks of 32 needed 255 registers and a stack on sm_90; 16 need 152.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.conv1d_checks import check_activation


# The step's token count is not specialised on (== 1, divisible by 16): a compile per kind of count
# mid-serving, for a mask along tokens whose loads are contiguous along channels.
@triton.jit(do_not_specialize=["num_tokens"])
def _conv1d_varlen_kernel(
    x_ptr, w_ptr, b_ptr, st_ptr, slots_ptr, cu_ptr, seq_ptr, y_ptr, num_tokens, dim,
    s_x_t, s_x_d, s_w_d, s_w_k, s_st_slot, s_st_d, s_st_k, s_y_t, s_y_d,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_t = tl.program_id(1).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    mask_t, mask_d = offs_t < num_tokens, offs_d < dim
    seq = tl.load(seq_ptr + offs_t, mask=mask_t, other=0)
    first = tl.load(cu_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seq, mask=mask_t, other=0).to(tl.int64)
    st_rows = st_ptr + slot[:, None] * s_st_slot + offs_d[None, :] * s_st_d
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in tl.static_range(K):
        src = offs_t - (K - 1) + k  # the packed input under tap k; before `first` it is in the state
        inside = src >= first
        new = tl.load(x_ptr + src[:, None] * s_x_t + offs_d[None, :] * s_x_d,
                      mask=(mask_t & inside)[:, None] & mask_d[None, :], other=0.0)
        stored = tl.load(st_rows + (K - 1 + src - first)[:, None] * s_st_k,
                         mask=(mask_t & ~inside)[:, None] & mask_d[None, :], other=0.0)
        u = tl.where(inside[:, None], new, stored.to(x_ptr.dtype.element_ty)).to(tl.float32)
        acc = acc + u * tl.load(w_ptr + offs_d * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(y_ptr + offs_t[:, None] * s_y_t + offs_d[None, :] * s_y_d, acc.to(y_ptr.dtype.element_ty),
             mask=mask_t[:, None] & mask_d[None, :])


@triton.jit
def _conv_state_varlen_kernel(
    x_ptr, st_ptr, slots_ptr, cu_ptr, row_seq_ptr, row_end_ptr, row_dst_ptr, end_dst_ptr, dim,
    s_x_t, s_x_d, s_st_slot, s_st_d, s_st_k,
    K: tl.constexpr, ROWS: tl.constexpr, HAS_END: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Writes the K-1 inputs before a packed token `end` of sequence s into a slot. ROWS: program
    r is capture r (its sequence, end token and slot given); else program s is sequence s's final
    state into its own slot (and, HAS_END, into end_dst[s] when that is >= 0)."""
    offs_d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.program_id(1)
    if ROWS:
        s = tl.load(row_seq_ptr + r).to(tl.int64)
    else:
        s = r.to(tl.int64)
    first = tl.load(cu_ptr + s).to(tl.int64)
    slot = tl.load(slots_ptr + s).to(tl.int64)
    if ROWS:
        end = tl.load(row_end_ptr + r).to(tl.int64)
        dst = tl.load(row_dst_ptr + r).to(tl.int64)
    else:
        end = tl.load(cu_ptr + s + 1).to(tl.int64)
        dst = slot
    col = tl.arange(0, BLOCK_K)
    mask_d, mask_col = offs_d < dim, col < K - 1
    src = end - (K - 1) + col  # the packed input that lands in column col
    inside = src >= first
    st_rows = st_ptr + slot * s_st_slot + offs_d[:, None] * s_st_d
    new = tl.load(x_ptr + src[None, :] * s_x_t + offs_d[:, None] * s_x_d,
                  mask=mask_d[:, None] & (mask_col & inside)[None, :], other=0.0)
    stored = tl.load(st_rows + (K - 1 + src - first)[None, :] * s_st_k,
                     mask=mask_d[:, None] & (mask_col & ~inside)[None, :], other=0.0)
    u = tl.where(inside[None, :], new, stored.to(x_ptr.dtype.element_ty)).to(st_ptr.dtype.element_ty)
    # A short sequence shifts its own slot's columns: every thread reads before any writes.
    tl.debug_barrier()
    mask = mask_d[:, None] & mask_col[None, :]
    tl.store(st_ptr + dst * s_st_slot + offs_d[:, None] * s_st_d + col[None, :] * s_st_k, u, mask=mask)
    if HAS_END:
        end_dst = tl.load(end_dst_ptr + s).to(tl.int64)
        if end_dst >= 0:
            tl.store(st_ptr + end_dst * s_st_slot + offs_d[:, None] * s_st_d + col[None, :] * s_st_k, u, mask=mask)


def causal_conv1d_varlen_triton(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor,
    activation: str | None = "silu",
    token_seq: Tensor | None = None,
    captures: tuple[Tensor, Tensor, Tensor] | None = None,
    end_slots: Tensor | None = None,
) -> Tensor:
    """``causal_conv1d_varlen_ref`` on the GPU (or the Triton interpreter): two launches, no host sync.

    Arguments:
        x: (T, D) packed tokens, fp32, bf16 or fp16, any strides.
        weight: (D, K) with K >= 2; bias: (D,) or None; activation: "silu" or None.
        conv_state: (slots, D, K-1) pool, any float dtype and strides; rows state_slots are read
            and overwritten IN PLACE with each sequence's final conv state.
        state_slots: (S,) int32/int64 distinct slots.
        cu_seqlens: (S+1,) int32/int64 on x's device, ascending from 0 to T (empty sequences
            allowed: their slot is left as it was).
        token_seq: (T,) int32/int64, the sequence of each token, or None to derive it from
            cu_seqlens (one small launch; pass it to share it between layers).
        captures: (sequence, end token, slot), (M,) int each, or None: the conv state before
            packed token `end` of that sequence (its K-1 inputs, from the stored state where the
            sequence has fewer before it) is written into the slot, before any slot is updated.
        end_slots: (S,) int or None: a slot that also receives sequence s's final conv state, -1
            for none. Capture and end slots must differ from state_slots and from each other.

    Returns:
        y: (T, D) in x.dtype.
    """
    check_activation(activation)
    total, dim = x.shape
    width = weight.shape[1]
    nseq = state_slots.shape[0]
    if weight.shape[0] != dim or width < 2:
        raise ValueError(f"weight must be ({dim}, K) with K >= 2, got {tuple(weight.shape)}")
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must be ({dim},), got {tuple(bias.shape)}")
    if conv_state.shape[1:] != (dim, width - 1):
        raise ValueError(f"conv_state must be (slots, {dim}, {width - 1}), got {tuple(conv_state.shape)}")
    if cu_seqlens.shape != (nseq + 1,):
        raise ValueError(f"cu_seqlens must be ({nseq + 1},) for {nseq} state slots, got {tuple(cu_seqlens.shape)}")
    if end_slots is not None and end_slots.shape != (nseq,):
        raise ValueError(f"end_slots must be ({nseq},), got {tuple(end_slots.shape)}")
    y = torch.empty((total, dim), dtype=x.dtype, device=x.device)
    if nseq == 0:
        return y
    block_d = min(128, triton.next_power_of_2(dim))
    block_k = triton.next_power_of_2(width - 1)
    if captures is not None and captures[0].numel():  # before any slot is overwritten
        _conv_state_varlen_kernel[(triton.cdiv(dim, block_d), captures[0].shape[0])](
            x, conv_state, state_slots, cu_seqlens, *captures, None, dim, *x.stride(), *conv_state.stride(),
            K=width, ROWS=True, HAS_END=False, BLOCK_D=block_d, BLOCK_K=block_k, num_warps=4,
        )
    if token_seq is None:
        tokens = torch.arange(total, device=x.device, dtype=cu_seqlens.dtype)
        token_seq = torch.searchsorted(cu_seqlens, tokens, right=True) - 1
    block_t = 16
    if total:
        _conv1d_varlen_kernel[(triton.cdiv(dim, block_d), triton.cdiv(total, block_t))](
            x, weight, bias, conv_state, state_slots, cu_seqlens, token_seq, y, total, dim,
            *x.stride(), *weight.stride(), *conv_state.stride(), *y.stride(),
            K=width, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_T=block_t, BLOCK_D=block_d,
            num_warps=4,
        )
    _conv_state_varlen_kernel[(triton.cdiv(dim, block_d), nseq)](
        x, conv_state, state_slots, cu_seqlens, None, None, None, end_slots, dim, *x.stride(), *conv_state.stride(),
        K=width, ROWS=False, HAS_END=end_slots is not None, BLOCK_D=block_d, BLOCK_K=block_k, num_warps=4,
    )
    return y
