"""Triton softmax top-k routing for Granite 4.0-H's and the Qwen MoEs' experts: matches
``softmax_topk_route_ref`` (or ``softmax_all_topk_route_ref`` without renormalization) in
``replayserve.ops.moe``, and aligns the pairs by expert in the same program (decode steps: one
launch where PyTorch takes a top-k, a softmax, a cast and the alignment's kernel).

One program routes up to 32 tokens on a (tokens, experts) tile: top_k rounds of the largest
remaining logit (the lowest id among equals), the softmax in fp32 over the chosen k (renormalized:
Granite's, and Qwen's with `norm_topk_prob`) or over all E (Qwen's without), stored in the weights'
dtype (transformers casts them to the hidden states' dtype); then ``align_pairs`` of
``moe_align_triton`` over the stored ids. Sized from shapes alone: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.moe import softmax_all_topk_route_ref, softmax_topk_route_ref
from replayserve.ops.moe_align_triton import (
    ALIGN_IN_ONE_PROGRAM,
    align_by_expert,
    align_meta,
    align_pairs,
    alignment_buffers,
)

_TOKENS_IN_ONE_PROGRAM = 32


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _softmax_route_align_kernel(
    logits_ptr, ids_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens, num_experts,
    s_l_t, s_l_e, num_blocks,
    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_X: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tok = tl.arange(0, BLOCK_T)
    expert = tl.arange(0, BLOCK_X)
    live = tok < num_tokens
    valid = live[:, None] & (expert[None, :] < num_experts)
    logit = tl.load(logits_ptr + tok.to(tl.int64)[:, None] * s_l_t + expert[None, :] * s_l_e, mask=valid,
                    other=0.0).to(tl.float32)
    logit = tl.where(valid, logit, -float("inf"))
    best = tl.where(live, tl.max(logit, axis=1), 0.0)  # the softmax's shift: the best logit (0: padding rows)
    if not RENORMALIZE:  # the denominator sums all E experts
        total = tl.sum(tl.where(valid, tl.exp(logit - best[:, None]), 0.0), axis=1)
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    chosen = tl.full([BLOCK_T, BLOCK_K], -float("inf"), tl.float32)
    for k in tl.static_range(TOP_K):
        top = tl.max(logit, axis=1)
        pick = tl.min(tl.where(logit == top[:, None], expert[None, :], BLOCK_X), axis=1)
        ids = tl.where(slots[None, :] == k, pick[:, None], ids)
        chosen = tl.where(slots[None, :] == k, top[:, None], chosen)
        logit = tl.where(expert[None, :] == pick[:, None], -float("inf"), logit)
    p = tl.where(live[:, None] & (slots[None, :] < TOP_K), tl.exp(chosen - best[:, None]), 0.0)
    if RENORMALIZE:
        total = tl.sum(p, axis=1)
    weights = p / tl.where(live, total, 1.0)[:, None]
    at = tok.to(tl.int64)[:, None] * TOP_K + slots[None, :]
    mask = live[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + at, ids, mask=mask)
    tl.store(weights_ptr + at, weights.to(weights_ptr.dtype.element_ty), mask=mask)
    tl.debug_barrier()  # every token's ids are stored before the alignment reads them
    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens * TOP_K, num_blocks,
                 BLOCK_M, BLOCK_E, BLOCK_N)


def softmax_route_align_triton(logits: Tensor, top_k: int, block_m: int, weights_dtype: torch.dtype,
                               renormalize: bool = True) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``softmax_topk_route_ref`` (``softmax_all_topk_route_ref`` without `renormalize`) then
    ``align_by_expert``: in one program for up to 32 tokens whose pairs it aligns (decode steps),
    else the reference's ops and the alignment.

    Arguments:
        logits: (T, E) router logits, any float dtype and strides.
        top_k: experts per token.
        block_m: the grouped GEMM's rows per block (``moe_triton.GemmConfig.block_m``).
        weights_dtype: the weights' dtype (the hidden states', as transformers casts them).
        renormalize: the chosen k's weights sum to 1 (Granite; Qwen's `norm_topk_prob`); else each
            is its softmax over all E experts.

    Returns:
        ids: (T, top_k) int32 from the kernel (int64 from the reference), best first.
        weights: (T, top_k) in weights_dtype.
        (sorted_pairs, block_expert, num_padded): as ``align_by_expert``.
    """
    num_tokens, num_experts = logits.shape
    num_pairs = num_tokens * top_k
    if not 0 < num_tokens <= _TOKENS_IN_ONE_PROGRAM or num_pairs > ALIGN_IN_ONE_PROGRAM:
        ids, weights = (softmax_topk_route_ref(logits, top_k) if renormalize
                        else softmax_all_topk_route_ref(logits, top_k, renormalize=False))
        return ids, weights.to(weights_dtype), align_by_expert(ids, num_experts, block_m)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)
    aligned = alignment_buffers(num_pairs, num_experts, block_m, logits.device)
    _softmax_route_align_kernel[(1,)](
        logits, ids, weights, *aligned, num_tokens, num_experts, *logits.stride(), aligned[1].numel(),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_T=triton.next_power_of_2(num_tokens),
        BLOCK_X=triton.next_power_of_2(num_experts), BLOCK_K=triton.next_power_of_2(top_k),
        **align_meta(num_experts, block_m, num_pairs), num_warps=8)
    return ids, weights, aligned
