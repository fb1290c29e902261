"""Triton routing for the routed experts: match ``topk_route_ref`` in ``replayserve.ops.moe``.

Nothing here reads a device value on the host, and every buffer and grid is sized from the shapes
alone (T tokens, top_k, E experts), so routing can be captured in a CUDA graph:

1. ``router_logits_triton``: the router's fp32 logits x @ W.T for decode-sized batches, casting x
   in the kernel (cuBLAS would take a cast kernel, a dot and a reduction: three launches).
2. ``topk_route_triton``: fp32 logits to top_k expert ids and weights (sigmoid, bias-corrected
   group-limited choice, normalisation, scaling), a block of tokens per program.
3. ``align_by_expert`` (``moe_align_triton``): the pairs grouped by expert for the grouped GEMM.
4. ``route_and_align_triton``: 2 and 3 in one program for decode-sized batches.

At one token of Nemotron-3-Nano's MoE layer (H200) the separate kernels took 3.6 (cast) + 4.3
(cuBLAS GEMV) + 3.3 (route) + 3.4 (align) us: latency, not bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.moe_align_triton import (
    ALIGN_IN_ONE_PROGRAM,
    align_by_expert,
    align_meta,
    align_pairs,
    alignment_buffers,
)

# Tokens one program routes: a (tokens, groups, experts per group) tile of fp32 lives in registers.
_ROUTE_TOKENS_PER_PROGRAM = 32


@triton.jit
def _router_logits_kernel(x_ptr, w_ptr, out_ptr, hidden, num_experts, s_x_t, s_x_k, s_w_e, s_w_k, s_o_t,
                          BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(1).to(tl.int64)
    e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    logits = _expert_logits(x_ptr, w_ptr, t, e, hidden, num_experts, s_x_t, s_x_k, s_w_e, s_w_k, BLOCK_E, BLOCK_H)
    tl.store(out_ptr + t * s_o_t + e, logits, mask=e < num_experts)


@triton.jit
def _expert_logits(x_ptr, w_ptr, t, e, hidden, num_experts, s_x_t, s_x_k, s_w_e, s_w_k,
                   BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr):
    """(BLOCK_E,) fp32 logits of token t for experts e: x cast in flight, BLOCK_H columns a step."""
    acc = tl.zeros([BLOCK_E, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_H):
        k = k0 + tl.arange(0, BLOCK_H)
        x = tl.load(x_ptr + t * s_x_t + k * s_x_k, mask=k < hidden, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + e[:, None] * s_w_e + k[None, :] * s_w_k,
                    mask=(e[:, None] < num_experts) & (k[None, :] < hidden), other=0.0)
        acc += w * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _route_tokens(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, tok, num_tokens, n_group, experts_per_group, scaling, s_l_t, s_l_e,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
    ALWAYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Routes the tokens `tok` (BLOCK_T,) at once, on (token, group, expert in group) tiles."""
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    expert = g[:, None] * experts_per_group + j[None, :]  # (BLOCK_G, BLOCK_J): expert ids by group
    in_range = (g[:, None] < n_group) & (j[None, :] < experts_per_group)
    live = tok < num_tokens
    valid = live[:, None, None] & in_range[None, :, :]
    logit = tl.load(logits_ptr + tok.to(tl.int64)[:, None, None] * s_l_t + expert[None, :, :] * s_l_e,
                    mask=valid, other=0.0).to(tl.float32)
    score = tl.sigmoid(logit)
    choice = score + tl.load(bias_ptr + expert, mask=in_range, other=0.0).to(tl.float32)[None, :, :]
    choice = tl.where(valid, choice, -float("inf"))
    if GROUPED:  # a group ranks by its two best choices; only the TOPK_GROUP best groups stay
        best = tl.max(choice, axis=2)
        first = tl.min(tl.where(choice == best[:, :, None], j[None, None, :], BLOCK_J), axis=2)
        second = tl.max(tl.where(j[None, None, :] == first[:, :, None], -float("inf"), choice), axis=2)
        group_score = tl.where(g[None, :] < n_group, best + second, -float("inf"))
        keep = (g[None, :] < 0) & live[:, None]
        for _ in tl.static_range(TOPK_GROUP):
            top = tl.max(group_score, axis=1)
            pick = tl.min(tl.where(group_score == top[:, None], g[None, :], BLOCK_G), axis=1)
            keep = keep | (g[None, :] == pick[:, None])
            group_score = tl.where(g[None, :] == pick[:, None], -float("inf"), group_score)
        choice = tl.where(keep[:, :, None], choice, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([tok.shape[0], BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([tok.shape[0], BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # the best remaining choice, the lowest id among equals
        top = tl.max(tl.max(choice, axis=2), axis=1)
        pick = tl.min(tl.min(tl.where(choice == top[:, None, None], expert[None, :, :], BLOCK_G * BLOCK_J),
                             axis=2), axis=1)
        chosen = valid & (expert[None, :, :] == pick[:, None, None])
        weight = tl.sum(tl.sum(tl.where(chosen, score, 0.0), axis=2), axis=1)
        ids = tl.where(slots[None, :] == k, pick[:, None], ids)
        weights = tl.where(slots[None, :] == k, weight[:, None], weights)
        choice = tl.where(chosen, -float("inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    row = TOP_K + ALWAYS
    at = tok.to(tl.int64)[:, None] * row + slots[None, :]
    mask = live[:, None] & (slots[None, :] < TOP_K)
    tl.store(ids_ptr + at, ids, mask=mask)
    tl.store(weights_ptr + at, weights * scaling, mask=mask)
    if ALWAYS > 0:  # the shared expert's pseudo-experts, after the E routed ones, at weight 1
        extra = tl.arange(0, BLOCK_S)
        at = tok.to(tl.int64)[:, None] * row + TOP_K + extra[None, :]
        on = live[:, None] & (extra[None, :] < ALWAYS)
        pseudo = n_group * experts_per_group + extra
        tl.store(ids_ptr + at, (pseudo[None, :] + 0 * tok[:, None]).to(tl.int32), mask=on)
        tl.store(weights_ptr + at, tl.full([tok.shape[0], BLOCK_S], 1.0, tl.float32), mask=on)


# Token, pair and block counts change every step. Specialised on (== 1, divisible by 16) they would
# compile a variant per kind of count mid-serving, for masks on gathered rows; the BLOCK_*
# constants follow their powers of two.
@triton.jit(do_not_specialize=["num_tokens"])
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, num_tokens, n_group, experts_per_group, scaling, s_l_t, s_l_e,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
    ALWAYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    _route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, tok, num_tokens, n_group, experts_per_group, scaling,
                  s_l_t, s_l_e, TOP_K, TOPK_GROUP, GROUPED, NORM, ALWAYS, BLOCK_S, BLOCK_G, BLOCK_J, BLOCK_K)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _route_align_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_tokens, n_group, experts_per_group, scaling, s_l_t, s_l_e, num_blocks,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
    ALWAYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
):
    tok = tl.arange(0, BLOCK_T)
    _route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, tok, num_tokens, n_group, experts_per_group, scaling,
                  s_l_t, s_l_e, TOP_K, TOPK_GROUP, GROUPED, NORM, ALWAYS, BLOCK_S, BLOCK_G, BLOCK_J, BLOCK_K)
    tl.debug_barrier()  # every token's ids are stored before the alignment reads them
    align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens * (TOP_K + ALWAYS), num_blocks,
                 BLOCK_M, BLOCK_E, BLOCK_N)


@triton.jit(do_not_specialize=["num_tokens", "num_blocks"])
def _logits_route_align_kernel(
    x_ptr, w_ptr, logits_ptr, arrivals_ptr, bias_ptr, ids_ptr, weights_ptr, sorted_ptr, block_expert_ptr,
    num_padded_ptr, num_tokens, hidden, num_experts, n_group, experts_per_group, scaling, s_x_t, s_x_k, s_w_e, s_w_k,
    num_blocks,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
    ALWAYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Program e writes every token's logit of expert e; the last program to arrive (an atomic
    count, reset by it for the next launch) routes and aligns them all, as _route_align_kernel."""
    e = tl.program_id(0) + tl.arange(0, 1)
    for t in range(num_tokens):
        logits = _expert_logits(x_ptr, w_ptr, t, e, hidden, num_experts, s_x_t, s_x_k, s_w_e, s_w_k, 1, BLOCK_H)
        tl.store(logits_ptr + t * num_experts + e, logits)
    tl.debug_barrier()  # all of this program's stores precede its arrival (the atomic releases them)
    if tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu") == num_experts - 1:
        tl.store(arrivals_ptr, 0)
        tok = tl.arange(0, BLOCK_T)
        _route_tokens(logits_ptr, bias_ptr, ids_ptr, weights_ptr, tok, num_tokens, n_group, experts_per_group, scaling,
                      num_experts, 1, TOP_K, TOPK_GROUP, GROUPED, NORM, ALWAYS, BLOCK_S, BLOCK_G, BLOCK_J, BLOCK_K)
        tl.debug_barrier()
        align_pairs(ids_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr, num_tokens * (TOP_K + ALWAYS), num_blocks,
                     BLOCK_M, BLOCK_E, BLOCK_N)


def router_logits_triton(x: Tensor, weight: Tensor) -> Tensor:
    """``x.to(weight.dtype) @ weight.t()`` in fp32, one program of 8 warps per (expert, token).

    Latency, not bytes, sets its time at decode sizes: many programs, each issuing its whole row
    in one load (a hidden size up to 4096), rather than a loop of dependent steps. H200, Nano's
    router (128 x 2688) at one token, graphed: 3.0 us, against 4.4 us for the two-expert, 4-warp
    programs this replaced (the best of 16 tilings, 2026-12-06).

    Arguments:
        x: (T, W) in any float dtype and strides.
        weight: (E, W) the router's weight (fp32).

    Returns:
        (T, E) float32 logits.
    """
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    out = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    if num_tokens:
        block_e = 1
        _router_logits_kernel[(triton.cdiv(num_experts, block_e), num_tokens)](
            x, weight, out, hidden, num_experts, *x.stride(), *weight.stride(), out.stride(0),
            BLOCK_E=block_e, BLOCK_H=min(4096, triton.next_power_of_2(hidden)), num_warps=8)
    return out


def _route_meta(logits: Tensor, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                always: int) -> dict:
    """The routing kernels' compile-time arguments, after checking the groups."""
    num_experts = logits.shape[1]
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide E={num_experts} and topk_group={topk_group} be 1..n_group")
    return dict(TOP_K=top_k, TOPK_GROUP=topk_group, GROUPED=n_group > 1, NORM=norm_topk_prob, ALWAYS=always,
                BLOCK_S=triton.next_power_of_2(max(always, 1)), BLOCK_G=triton.next_power_of_2(n_group),
                BLOCK_J=triton.next_power_of_2(num_experts // n_group), BLOCK_K=triton.next_power_of_2(top_k))


def _route_buffers(num_tokens: int, width: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The (T, top_k + S) int32 ids and float32 weights the routing kernels write."""
    return (torch.empty(num_tokens, width, dtype=torch.int32, device=device),
            torch.empty(num_tokens, width, dtype=torch.float32, device=device))


def topk_route_triton(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                      norm_topk_prob: bool, scaling: float, always: int = 0) -> tuple[Tensor, Tensor]:
    """``topk_route_ref`` on the GPU, in fp32.

    Arguments:
        logits: (T, E) router logits, any float dtype and strides.
        bias: (E,) ``e_score_correction_bias``.
        top_k, n_group, topk_group, norm_topk_prob, scaling: as ``topk_route_ref``.
        always: S experts E .. E + S - 1 appended to every token's choice at weight 1 (the shared
            expert folded in as pseudo-experts, ``MoE.num_folded``).

    Returns:
        ids: (T, top_k + S) int32, best choice first (the lowest id among equal choices).
        weights: (T, top_k + S) float32.
    """
    meta = _route_meta(logits, top_k, n_group, topk_group, norm_topk_prob, always)
    num_tokens, num_experts = logits.shape
    ids, weights = _route_buffers(num_tokens, top_k + always, logits.device)
    if num_tokens:
        block_t = min(_ROUTE_TOKENS_PER_PROGRAM, triton.next_power_of_2(num_tokens))
        _route_kernel[(triton.cdiv(num_tokens, block_t),)](
            logits, bias, ids, weights, num_tokens, n_group, num_experts // n_group, float(scaling),
            *logits.stride(), BLOCK_T=block_t, num_warps=4 if block_t <= 4 else 8, **meta)
    return ids, weights


def route_and_align_triton(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                           norm_topk_prob: bool, scaling: float, block_m: int, always: int = 0
                           ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``topk_route_triton`` then ``align_by_expert`` over the E + S experts, in one program when
    T <= 32 and the pairs fit it (decode steps), else as the two calls.

    Returns:
        ids, weights: as ``topk_route_triton``.
        (sorted_pairs, block_expert, num_padded): as ``align_by_expert``.
    """
    num_tokens, num_experts = logits.shape
    num_pairs = num_tokens * (top_k + always)
    if not 0 < num_tokens <= _ROUTE_TOKENS_PER_PROGRAM or num_pairs > ALIGN_IN_ONE_PROGRAM:
        ids, weights = topk_route_triton(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, always)
        return ids, weights, align_by_expert(ids, num_experts + always, block_m)
    meta = _route_meta(logits, top_k, n_group, topk_group, norm_topk_prob, always)
    ids, weights = _route_buffers(num_tokens, top_k + always, logits.device)
    aligned = alignment_buffers(num_pairs, num_experts + always, block_m, logits.device)
    block_t = triton.next_power_of_2(num_tokens)
    _route_align_kernel[(1,)](
        logits, bias, ids, weights, *aligned, num_tokens, n_group, num_experts // n_group, float(scaling),
        *logits.stride(), aligned[1].numel(), BLOCK_T=block_t, **meta,
        **align_meta(num_experts + always, block_m, num_pairs), num_warps=8)
    return ids, weights, aligned


def arrivals_counter(device: torch.device) -> Tensor:
    """The (1,) int32 zero that ``logits_route_align_triton`` counts its programs' arrivals in; the
    last program resets it, so one counter serves every later launch on the same stream."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def logits_route_align_triton(x: Tensor, weight: Tensor, arrivals: Tensor, bias: Tensor, top_k: int, n_group: int,
                              topk_group: int, norm_topk_prob: bool, scaling: float, block_m: int, always: int = 0
                              ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor]]:
    """``router_logits_triton`` then ``route_and_align_triton`` in one launch, for up to 32 tokens
    whose pairs one program aligns: one program per expert computes the logits, and the last one
    to finish routes and aligns (one launch and its gap fewer per MoE layer at decode).

    Arguments:
        x: (T, W) any float dtype and strides; weight: (E, W) the router's weight (fp32).
        arrivals: ``arrivals_counter(x.device)``, zero between launches; launches sharing one
            counter must be ordered (one stream).
        bias, top_k, n_group, topk_group, norm_topk_prob, scaling, block_m, always: as
            ``route_and_align_triton``.

    Returns:
        As ``route_and_align_triton``.
    """
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    num_pairs = num_tokens * (top_k + always)
    if not 0 < num_tokens <= _ROUTE_TOKENS_PER_PROGRAM or num_pairs > ALIGN_IN_ONE_PROGRAM:
        raise ValueError(f"{num_tokens} tokens of {top_k + always} pairs: route them with route_and_align_triton")
    if weight.shape[1] != hidden or arrivals.shape != (1,) or arrivals.dtype != torch.int32:
        raise ValueError(f"weight {tuple(weight.shape)} must be (E, {hidden}) and arrivals a (1,) int32 counter")
    logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
    meta = _route_meta(logits, top_k, n_group, topk_group, norm_topk_prob, always)
    ids, weights = _route_buffers(num_tokens, top_k + always, x.device)
    aligned = alignment_buffers(num_pairs, num_experts + always, block_m, x.device)
    _logits_route_align_kernel[(num_experts,)](
        x, weight, logits, arrivals, bias, ids, weights, *aligned, num_tokens, hidden, num_experts, n_group,
        num_experts // n_group, float(scaling), *x.stride(), *weight.stride(), aligned[1].numel(),
        BLOCK_T=triton.next_power_of_2(num_tokens), **meta, **align_meta(num_experts + always, block_m, num_pairs),
        BLOCK_H=min(4096, triton.next_power_of_2(hidden)), num_warps=8)
    return ids, weights, aligned
