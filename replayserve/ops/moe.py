"""Nemotron-H's routed experts in plain PyTorch: the oracles of ``replayserve.ops.moe_triton``.

``topk_route_ref`` turns router logits into each token's experts and weights; ``fused_moe_ref``
runs the chosen experts (relu^2 MLPs without bias) one expert at a time and sums their outputs
per token. The expert loop asks the host which experts are in use (a sync): the Triton path
does not.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.activation import relu_square_ref


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


def fused_moe_ref(x: Tensor, w_up: Tensor, w_down: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """The routed experts' sum: sum_k weights[t, k] * down_e(relu(up_e(x[t]))^2) with e = ids[t, k].

    Arguments:
        x: (T, W) the experts' input (hidden or latent width).
        w_up: (E, I, W) up projections, nn.Linear layout, x's dtype.
        w_down: (E, W, I) down projections.
        ids: (T, top_k) integer expert ids.
        weights: (T, top_k) routing weights (float32 for half models).

    Returns:
        (T, W) in weights.dtype: each expert runs in x's dtype, its output is weighted and summed
        in weights.dtype.
    """
    routed = torch.zeros_like(x, dtype=weights.dtype)
    for e in ids.unique().tolist():
        token, k = (ids == e).nonzero(as_tuple=True)
        out = F.linear(relu_square_ref(F.linear(x[token], w_up[e])), w_down[e]) * weights[token, k, None]
        routed.index_add_(0, token, out.to(routed.dtype))
    return routed
