"""Nemotron-H feed-forward layers: the relu^2 MLP and the sigmoid-routed MoE."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.ops.activation import relu_square_ref
from replayserve.ops.dtypes import triton_ok


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up_proj(x)
        if triton_ok(h) and h.is_contiguous():  # one kernel, in place
            from replayserve.ops.activation_triton import relu_square_triton_

            return self.down_proj(relu_square_triton_(h))
        return self.down_proj(relu_square_ref(h))


class TopkRouter(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k choice, weights from the raw scores."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        # Kept in the compute dtype (float32 for half models), as Hugging Face keeps it.
        self.weight = nn.Parameter(torch.zeros(self.num_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> expert ids (T, top_k) int64, weights (T, top_k) in the router dtype."""
        scores = torch.sigmoid(x.to(self.weight.dtype) @ self.weight.t())
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(self.topk_group, dim=-1).indices, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.num_experts // self.n_group, dim=1), -torch.inf)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        width = cfg.moe_latent_size or cfg.hidden_size
        self.gate = TopkRouter(cfg)
        self.experts = nn.ModuleList(
            MLP(width, cfg.moe_intermediate_size, bias=False) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias)
        self.fc1_latent_proj: nn.Module = nn.Identity()
        self.fc2_latent_proj: nn.Module = nn.Identity()
        if cfg.moe_latent_size is not None:
            self.fc1_latent_proj = nn.Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = nn.Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden)."""
        ids, weights = self.gate(x)
        routed_in = self.fc1_latent_proj(x)
        routed = torch.zeros_like(routed_in, dtype=weights.dtype)
        for e in ids.unique().tolist():
            token, k = (ids == e).nonzero(as_tuple=True)
            out = self.experts[e](routed_in[token]) * weights[token, k, None]
            routed.index_add_(0, token, out.to(routed.dtype))
        return self.fc2_latent_proj(routed.to(x.dtype)) + self.shared_experts(x)
