"""The routed experts in plain PyTorch: the oracles of ``moe_triton`` and the routing kernels.

``router_logits_ref`` and ``topk_route_ref`` turn a token into its experts and weights, as
``softmax_topk_route_ref`` (Granite 4.0-H) and ``softmax_all_topk_route_ref`` (the Qwen MoEs) do;
``fused_moe_ref`` runs the chosen experts (relu^2 MLPs without bias) one expert at a time and sums
their outputs per token; FP8 experts (float8_e4m3fn stacks with one scale per expert, as ModelOpt
stores each expert's projections) are dequantized as they are used, then run the same way. The
expert loop asks the host which experts are in use (a sync): the Triton path does not.
``router_logits`` and ``topk_route`` are Nemotron-H's routing's entry points (``dispatch.use_triton``);
its grouped-GEMM path is its MoE layer's own composition (``layers.mlp.MoE``: the shared expert
folded in, FP8 experts, the one-launch logits and routing). Granite 4.0-H's and the Qwen MoEs'
routed experts have one entry point, ``moe_softmax.softmax_moe`` (not here: the kernel modules
import this one).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.activation import relu_square_ref, silu_mul_ref
from replayserve.ops.dispatch import use_triton
from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8

# Up to this many tokens (decode steps) the router's logits come from one Triton kernel; larger
# batches are matrix products for cuBLAS.
ROUTER_KERNEL_MAX_TOKENS = 32


def router_logits_ref(x: Tensor, weight: Tensor) -> Tensor:
    """x (T, W) any float dtype, weight (E, W) the router's -> (T, E) logits in weight.dtype."""
    return x.to(weight.dtype) @ weight.t()


def router_logits(x: Tensor, weight: Tensor) -> Tensor:
    """``router_logits_ref``; decode-sized batches with an fp32 router take one Triton kernel that
    casts x in flight (cuBLAS takes a cast, a dot and a reduction: 7.9 us at one token of
    Nemotron-3-Nano on the H200)."""
    if use_triton(x) and weight.dtype == torch.float32 and x.shape[0] <= ROUTER_KERNEL_MAX_TOKENS:
        from replayserve.ops.moe_route_triton import router_logits_triton

        return router_logits_triton(x, weight)
    return router_logits_ref(x, weight)


def topk_route_ref(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                   scaling: float) -> tuple[Tensor, Tensor]:
    """Sigmoid scores, bias-corrected group-limited top-k choice, weights from the raw scores.

    Arguments:
        logits: (T, E) router logits in the router dtype (float32 for half models).
        bias: (E,) ``e_score_correction_bias``: shifts the choice, not the weights.
        top_k: experts per token.
        n_group: expert groups (E % n_group == 0); groups rank by the sum of their two best experts.
        topk_group: groups a token may choose from.
        norm_topk_prob: divide the chosen scores by their sum.
        scaling: ``routed_scaling_factor``, applied last.

    Returns:
        ids: (T, top_k) int64 expert ids, best choice first.
        weights: (T, top_k) in logits.dtype.
    """
    num_experts = logits.shape[-1]
    scores = torch.sigmoid(logits)
    choice = scores + bias
    if n_group > 1:
        grouped = choice.view(-1, n_group, num_experts // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(num_experts // n_group, dim=1), -torch.inf)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def topk_route(logits: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
               scaling: float, always: int = 0) -> tuple[Tensor, Tensor]:
    """``topk_route_ref``, by ``topk_route_triton`` for fp32 logits where it serves: ids int32
    there, int64 from the reference. `always` = S > 0 (the kernel only) ends each token's row with
    experts E .. E + S - 1 at weight 1."""
    if use_triton(logits, (torch.float32,)):
        from replayserve.ops.moe_route_triton import topk_route_triton

        return topk_route_triton(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling, always=always)
    if always:
        raise ValueError("always-on experts are appended by the Triton router only")
    return topk_route_ref(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling)


def check_expert_scales(w_up: Tensor, w_down: Tensor, scales: tuple[Tensor, Tensor] | None) -> None:
    """Raises ValueError unless the stacks are float8_e4m3fn with ``scales`` = (up, down), each
    (E_s,) float32 on the stacks' device with 1 <= E_s <= E (``expert_scale``), or 16-bit and
    ``scales`` is None."""
    fp8 = [w.dtype == FP8_DTYPE for w in (w_up, w_down)]
    if scales is None:
        if any(fp8):
            raise ValueError("float8_e4m3fn expert stacks need their per-expert scales")
        return
    if not all(fp8):
        raise ValueError(f"scales are for float8_e4m3fn expert stacks, got {w_up.dtype} / {w_down.dtype}")
    num_experts = w_up.shape[0]
    for s in scales:
        if s.dim() != 1 or not 1 <= s.numel() <= num_experts or s.dtype != torch.float32 or s.device != w_up.device:
            raise ValueError(f"expert scales must be (E_s,) float32 with 1 <= E_s <= {num_experts} on "
                             f"{w_up.device}, got {tuple(s.shape)} {s.dtype} on {s.device}")
    if scales[0].numel() != scales[1].numel():
        raise ValueError(f"up and down scales differ in length: {scales[0].numel()} and {scales[1].numel()}")


def expert_scale(scale: Tensor, expert: int) -> Tensor:
    """Expert ``expert``'s weight scale from ``scale`` (E_s,): ``scale[min(expert, E_s - 1)]``. The
    experts past the last scale are the pieces of the one shared expert the MoE layer folds into its
    stacks (``MoE.stacked_experts``), all quantized with its one stored scale."""
    return scale[min(expert, scale.numel() - 1)]


def softmax_topk_route_ref(logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """Granite 4.0-H's routing (transformers' GraniteMoeHybridTopKGating): the top-k logits, weighted
    by the softmax over those k (equal to softmax-then-top-k renormalised over the k).

    Arguments:
        logits: (T, E) router logits, any float dtype (Granite's are in the hidden states' dtype).
        top_k: experts per token.

    Returns:
        ids: (T, top_k) int64, best first.
        weights: (T, top_k) float32 (the logits cast first).
    """
    top, ids = logits.float().topk(top_k, dim=-1)
    return ids, torch.softmax(top, dim=-1)


def softmax_all_topk_route_ref(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """The Qwen3-Next / Qwen3.5-MoE routing (transformers' Qwen3NextTopKRouter): the softmax over all
    E experts in float32, its top k, divided by their sum when `renormalize` (`norm_topk_prob`; then
    equal, to rounding, to ``softmax_topk_route_ref``).

    Arguments:
        logits: (T, E) router logits, any float dtype (Qwen's are in the hidden states' dtype).
        top_k: experts per token.
        renormalize: the chosen k's weights sum to 1; else they are their share of all E.

    Returns:
        ids: (T, top_k) int64, best first.
        weights: (T, top_k) float32, or float64 for float64 logits.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    weights, ids = probs.topk(top_k, dim=-1)
    return ids, weights / weights.sum(dim=-1, keepdim=True) if renormalize else weights


def fused_moe_ref(x: Tensor, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor,
                  scales: tuple[Tensor, Tensor] | None = None, swiglu: bool = False) -> Tensor:
    """The routed experts' sum: sum_k weights[t, k] * down_e(act(up_e(x[t]))) with e = ids[t, k].

    Arguments:
        x: (T, W) the experts' input (hidden or latent width).
        w_up: (E, I, W) up projections, nn.Linear layout, x's dtype, or float8_e4m3fn with ``scales``;
            with `swiglu` (E, 2I, W), the gate's I rows then the up's (Granite 4.0-H's `input_linear`).
        w_down: (E, W, I) down projections, likewise.
        ids: (T, top_k) integer expert ids.
        weights: (T, top_k) routing weights (float32 for half models).
        scales: (up, down) per-expert weight scales of FP8 stacks (``check_expert_scales``): expert
            e's weights are ``dequantize_fp8(w[e], expert_scale(scale, e), x.dtype)``, the values
            the FP8 kernel multiplies (rounded once to x's dtype here, kept in fp32 there).
        swiglu: act is silu(gate) * up; else relu^2 (Nemotron-H's).

    Returns:
        (T, W) in weights.dtype: each expert runs in x's dtype, its output is weighted and summed
        in weights.dtype.
    """
    check_expert_scales(w_up, w_down, scales)
    routed = torch.zeros_like(x, dtype=weights.dtype)
    for e in ids.unique().tolist():
        token, k = (ids == e).nonzero(as_tuple=True)
        up, down = w_up[e], w_down[e]
        if scales is not None:
            up = dequantize_fp8(up, expert_scale(scales[0], e), x.dtype)
            down = dequantize_fp8(down, expert_scale(scales[1], e), x.dtype)
        inner = F.linear(x[token], up)
        if swiglu:
            gate, up_half = inner.chunk(2, dim=-1)
            inner = silu_mul_ref(gate, up_half)
        else:
            inner = relu_square_ref(inner)
        out = F.linear(inner, down) * weights[token, k, None]
        routed.index_add_(0, token, out.to(routed.dtype))
    return routed

