"""Nemotron-H feed-forward layers: the relu^2 MLP and the sigmoid-routed MoE."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.ops.activation import relu_square_ref
from replayserve.ops.dtypes import triton_ok
from replayserve.ops.moe import fused_moe_ref, topk_route_ref


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
        """x (T, hidden) -> expert ids (T, top_k), weights (T, top_k) in the router dtype.

        Ids are int64 from the reference, int32 from the Triton kernel (CUDA, router in fp32)."""
        logits = x.to(self.weight.dtype) @ self.weight.t()
        args = (self.top_k, self.n_group, self.topk_group, self.norm_topk_prob, self.scaling)
        if triton_ok(logits) and logits.dtype == torch.float32:
            from replayserve.ops.moe_triton import topk_route_triton

            return topk_route_triton(logits, self.e_score_correction_bias, *args)
        return topk_route_ref(logits, self.e_score_correction_bias, *args)


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

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed experts' weights as (E, I, W) up and (E, W, I) down projections.

        Each expert's parameter (`experts.{e}.up_proj.weight`, the checkpoint's name) is made a view
        of its slice, so the stacks cost no memory of their own and a load's in-place copies land in
        them. Restacked where the parameters stopped being those views (moved by `.to()`, cast):
        the models' `cast_` stacks at build time, so a forward only compares the first and the last
        parameter's address with the stacks' (all 2E would cost ~1 ms of module lookups per layer
        and call, which eager prefill pays; one parameter replaced alone is not noticed)."""
        first, last = self.experts[0].up_proj.weight, self.experts[-1].down_proj.weight
        stacked = getattr(self, "_stacked", None)
        if (stacked is not None and first.data_ptr() == stacked[0].data_ptr()
                and last.data_ptr() == stacked[1][-1].data_ptr()):
            return stacked
        params = [m.up_proj.weight for m in self.experts] + [m.down_proj.weight for m in self.experts]
        num = len(self.experts)
        with torch.no_grad():
            stacked = (torch.stack([p.detach() for p in params[:num]]),
                       torch.stack([p.detach() for p in params[num:]]))
            for i, p in enumerate(params):
                p.data = stacked[i // num][i % num]
        self._stacked = stacked
        return stacked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). On CUDA (fp32, bf16, fp16) the routed experts run as Triton
        kernels without a host sync (CUDA-graph safe); elsewhere as the per-expert reference loop."""
        ids, weights = self.gate(x)
        routed_in = self.fc1_latent_proj(x)
        w_up, w_down = self.stacked_experts()
        shared = self.shared_experts(x)
        if triton_ok(routed_in):
            from replayserve.ops.moe_triton import fused_moe_triton

            if isinstance(self.fc2_latent_proj, nn.Identity):  # the shared expert added in the same kernel
                return fused_moe_triton(routed_in, w_up, w_down, ids, weights, add=shared)
            return self.fc2_latent_proj(fused_moe_triton(routed_in, w_up, w_down, ids, weights)) + shared
        routed = fused_moe_ref(routed_in, w_up, w_down, ids, weights)
        return self.fc2_latent_proj(routed.to(x.dtype)) + shared
