"""Triton routed experts: match ``topk_route_ref`` and ``fused_moe_ref`` in ``replayserve.ops.moe``.

Nothing here reads a device value on the host, and every buffer and grid is sized from the shapes
alone (T tokens, top_k, E experts), so one MoE layer can be captured in a CUDA graph:

1. ``topk_route_triton``: one program per token turns its fp32 router logits into top_k expert ids
   and weights (sigmoid, bias-corrected group-limited choice, normalisation, scaling).
2. ``align_by_expert``: the T * top_k (token, k) pairs sorted by expert (stably: by pair index
   within an expert), each expert's run padded to a multiple of BLOCK_M, in a buffer of the largest
   padded size the shapes allow; padding entries hold T * top_k and are masked. One Triton program
   does it for decode-sized batches; larger ones take a few sync-free PyTorch ops.
3. Two launches of one grouped GEMM over those blocks, a block's expert read from the device: the
   up projection with relu^2 in its epilogue (kept in x's dtype, as the reference keeps it), then
   the down projection times the routing weight, one row per pair in x's dtype (the reference
   rounds each expert's output to x's dtype too, before weighting).
4. ``_sum_topk_kernel`` sums each token's top_k rows in fp32 in a fixed order and adds the shared
   expert's output. Writing (T * top_k, W) and reducing costs a pass over that buffer (2 bytes an
   element in bf16) but, unlike fp32 atomics into the output, gives the same bits on every run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

# At most this many (token, k) pairs are aligned by the one-program kernel (decode steps: one launch
# instead of about 15); it walks the pairs in chunks, so larger batches take the PyTorch ops. Untuned.
_ALIGN_IN_ONE_PROGRAM = 1024


@triton.jit
def _route_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, n_group, experts_per_group, scaling, s_l_t, s_l_e,
    TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, GROUPED: tl.constexpr, NORM: tl.constexpr,
    ALWAYS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_J)
    expert = g[:, None] * experts_per_group + j[None, :]  # (BLOCK_G, BLOCK_J): expert ids by group
    valid = (g[:, None] < n_group) & (j[None, :] < experts_per_group)
    logit = tl.load(logits_ptr + t * s_l_t + expert * s_l_e, mask=valid, other=0.0).to(tl.float32)
    score = tl.sigmoid(logit)
    choice = score + tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, -float("inf"))
    if GROUPED:  # a group ranks by its two best choices; only the TOPK_GROUP best groups stay
        best = tl.max(choice, axis=1)
        first = tl.min(tl.where(choice == best[:, None], j[None, :], BLOCK_J), axis=1)
        second = tl.max(tl.where(j[None, :] == first[:, None], -float("inf"), choice), axis=1)
        group_score = tl.where(g < n_group, best + second, -float("inf"))
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            pick = tl.min(tl.where(group_score == tl.max(group_score, axis=0), g, BLOCK_G), axis=0)
            keep = keep | (g == pick)
            group_score = tl.where(g == pick, -float("inf"), group_score)
        choice = tl.where(keep[:, None], choice, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    ids = tl.zeros([BLOCK_K], dtype=tl.int32)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k in tl.static_range(TOP_K):  # the best remaining choice, the lowest id among equals
        top = tl.max(tl.max(choice, axis=1), axis=0)
        pick = tl.min(tl.min(tl.where(choice == top, expert, BLOCK_G * BLOCK_J), axis=1), axis=0)
        chosen = valid & (expert == pick)
        weight = tl.sum(tl.sum(tl.where(chosen, score, 0.0), axis=1), axis=0)
        ids = tl.where(slots == k, pick, ids)
        weights = tl.where(slots == k, weight, weights)
        choice = tl.where(chosen, -float("inf"), choice)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    mask = slots < TOP_K
    row = TOP_K + ALWAYS
    tl.store(ids_ptr + t * row + slots, ids, mask=mask)
    tl.store(weights_ptr + t * row + slots, weights * scaling, mask=mask)
    if ALWAYS > 0:  # the shared expert's pseudo-experts, after the E routed ones, at weight 1
        extra = tl.arange(0, BLOCK_S)
        on = extra < ALWAYS
        tl.store(ids_ptr + t * row + TOP_K + extra, (n_group * experts_per_group + extra).to(tl.int32), mask=on)
        tl.store(weights_ptr + t * row + TOP_K + extra, tl.full(extra.shape, 1.0, tl.float32), mask=on)


@triton.jit
def _align_kernel(
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


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, weights_ptr, sorted_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, n_out, k_in, pairs_per_row,
    s_a_r, s_a_k, s_w_e, s_w_n, s_w_k, s_o_p, s_o_n,
    RELU2: tl.constexpr, WEIGHTED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):  # past the last expert's blocks
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    live = pair < num_pairs
    row = (pair // pairs_per_row).to(tl.int64)  # x is read once per token, the intermediate per pair
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + row[:, None] * s_a_r + offs_k[None, :] * s_a_k
    w_ptrs = w_ptr + expert * s_w_e + offs_n[None, :].to(tl.int64) * s_w_n + offs_k[:, None] * s_w_k
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        in_k = offs_k < k_in - k0
        a = tl.load(a_ptrs, mask=live[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=in_k[:, None] & (offs_n[None, :] < n_out), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * s_a_k
        w_ptrs += BLOCK_K * s_w_k
    if RELU2:
        acc = tl.maximum(acc, 0.0)
        acc = acc * acc
    if WEIGHTED:
        acc = acc * tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * s_o_p + offs_n[None, :] * s_o_n
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (offs_n[None, :] < n_out))


@triton.jit
def _sum_topk_kernel(
    pairs_ptr, add_ptr, out_ptr, width, s_p_p, s_add_t, s_o_t,
    TOP_K: tl.constexpr, HAS_ADD: tl.constexpr, BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = offs < width
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(pairs_ptr + (t * TOP_K + k) * s_p_p + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:  # the reference rounds the routed sum to x's dtype, then adds in that dtype
        acc = acc.to(out_ptr.dtype.element_ty).to(tl.float32)
        acc += tl.load(add_ptr + t * s_add_t + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * s_o_t + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def topk_route_triton(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
                      norm_topk_prob: bool, scaling: float, always: int = 0) -> tuple[Tensor, Tensor]:
    """``topk_route_ref`` on the GPU, in fp32, one program per token.

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
    num_tokens, num_experts = logits.shape
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(f"n_group={n_group} must divide E={num_experts} and topk_group={topk_group} be 1..n_group")
    ids = torch.empty(num_tokens, top_k + always, dtype=torch.int32, device=logits.device)
    weights = torch.empty(num_tokens, top_k + always, dtype=torch.float32, device=logits.device)
    if num_tokens:
        per_group = num_experts // n_group
        _route_kernel[(num_tokens,)](
            logits, bias, ids, weights, n_group, per_group, float(scaling), *logits.stride(),
            TOP_K=top_k, TOPK_GROUP=topk_group, GROUPED=n_group > 1, NORM=norm_topk_prob, ALWAYS=always,
            BLOCK_S=triton.next_power_of_2(max(always, 1)),
            BLOCK_G=triton.next_power_of_2(n_group), BLOCK_J=triton.next_power_of_2(per_group),
            BLOCK_K=triton.next_power_of_2(top_k), num_warps=4,
        )
    return ids, weights


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M-row blocks T * top_k = num_pairs pairs can need: each expert that gets a
    pair pads its run by fewer than block_m rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def align_by_expert(ids: Tensor, num_experts: int, block_m: int,
                    one_program: bool | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The (token, k) pairs grouped by expert in padded blocks, without a host sync.

    Arguments:
        ids: (T, top_k) integer expert ids in [0, E).
        num_experts: E.
        block_m: rows per block; each expert's run is padded to a multiple of it.
        one_program: the one-program Triton kernel (default: up to 1024 pairs) or PyTorch ops.

    Returns:
        sorted_pairs: (max_blocks * block_m,) int32 pair indices t * top_k + k, by expert then
            pair; padding holds T * top_k.
        block_expert: (max_blocks,) int32, the expert of each block; blocks past num_padded hold
            any value and are skipped.
        num_padded: (1,) int32, the padded length in use.
    """
    flat = ids.reshape(-1).to(torch.int32)
    num_pairs, dev = flat.numel(), ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    if one_program is None:
        one_program = num_pairs <= _ALIGN_IN_ONE_PROGRAM
    if one_program:
        sorted_pairs = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
        num_padded = torch.empty(1, dtype=torch.int32, device=dev)
        block_e = triton.next_power_of_2(num_experts)
        _align_kernel[(1,)](flat, sorted_pairs, block_expert, num_padded, num_pairs, blocks, BLOCK_M=block_m,
                            BLOCK_E=block_e, BLOCK_N=max(16, 8192 // block_e), num_warps=4)
        return sorted_pairs, block_expert, num_padded
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


@dataclass(frozen=True)
class GemmConfig:
    """Tiles and launch settings of the two grouped GEMMs (powers of two; tl.dot needs 16 and up)."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_pairs: int, num_experts: int) -> GemmConfig:
    """Tiles by the mean pairs per expert: decode reads weights (narrow rows, deep K steps), prefill
    is compute bound (wide tiles, more warps). Untuned guesses: `benchmarks/bench_moe.py --sweep`
    measures the alternatives on the card."""
    mean = num_pairs / num_experts
    if mean <= 16:
        return GemmConfig(block_m=16, block_n=64, block_k=128, num_warps=4, num_stages=4)
    if mean <= 64:
        return GemmConfig(block_m=32 if mean <= 32 else 64, block_n=64, block_k=64, num_warps=4, num_stages=4)
    # H200 sweep, Nano's shape at 2048 tokens (96 pairs an expert): 1065 us against 1185 us for
    # the 64-row, 8-warp tiles this replaced.
    return GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3)


def fused_moe_triton(x: Tensor, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
                     add: Tensor | None = None, config: GemmConfig | None = None) -> Tensor:
    """``fused_moe_ref`` on the GPU, rounded to x's dtype, plus ``add`` (the shared expert).

    Arguments:
        x: (T, W) fp32, bf16 or fp16, rows may be strided.
        w_up: (E, I, W) in x's dtype, any strides.
        w_down: (E, W, I) in x's dtype.
        ids: (T, top_k) integer expert ids.
        weights: (T, top_k) routing weights.
        add: optional (T, W) added after the routed sum is rounded to x's dtype, as the reference's
            ``routed.to(x.dtype) + shared`` does.
        config: the GEMMs' tiles; by default ``default_config`` of the shapes.

    Returns:
        (T, W) contiguous in x.dtype.
    """
    num_tokens, width = x.shape
    num_experts, inner, _ = w_up.shape
    top_k = ids.shape[1]
    if w_up.shape[2] != width or w_down.shape != (num_experts, width, inner):
        raise ValueError(f"w_up {tuple(w_up.shape)} / w_down {tuple(w_down.shape)} do not fit x of width {width}")
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    num_pairs = num_tokens * top_k
    cfg = config or default_config(num_pairs, num_experts)
    sorted_pairs, block_expert, num_padded = align_by_expert(ids, num_experts, cfg.block_m)
    weights = weights.reshape(-1).contiguous()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding, as PyTorch's
    common = dict(PRECISION=precision, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    inter = torch.empty(num_pairs, inner, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(inner, cfg.block_n))](
        x, w_up, inter, weights, sorted_pairs, block_expert, num_padded, num_pairs, inner, width, top_k,
        *x.stride(), *w_up.stride(), *inter.stride(), RELU2=True, WEIGHTED=False, **common,
    )
    per_pair = torch.empty(num_pairs, width, dtype=x.dtype, device=x.device)
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(width, cfg.block_n))](
        inter, w_down, per_pair, weights, sorted_pairs, block_expert, num_padded, num_pairs, width, inner, 1,
        *inter.stride(), *w_down.stride(), *per_pair.stride(), RELU2=False, WEIGHTED=True, **common,
    )
    if add is not None and (add.shape != out.shape or add.stride(1) != 1):
        raise ValueError(f"add must be ({num_tokens}, {width}) with unit column stride, got {tuple(add.shape)}")
    block_w = min(1024, triton.next_power_of_2(width))
    _sum_topk_kernel[(num_tokens, triton.cdiv(width, block_w))](
        per_pair, add if add is not None else out, out, width, per_pair.stride(0),
        add.stride(0) if add is not None else 0, out.stride(0),
        TOP_K=top_k, HAS_ADD=add is not None, BLOCK_W=block_w, num_warps=4,
    )
    return out
