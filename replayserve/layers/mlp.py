"""Nemotron-H feed-forward layers: the relu^2 MLP and the sigmoid-routed MoE."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.fp8_expert_stacks import stack_scales_
from replayserve.layers.fp8_linear import FP8Linear
from replayserve.layers.linear import Linear
from replayserve.layers.stacked import stack_as_views_
from replayserve.ops.activation import relu_square
from replayserve.ops.dispatch import use_triton
from replayserve.ops.moe import ROUTER_KERNEL_MAX_TOKENS, fused_moe_ref, router_logits, topk_route

# Up to this many tokens (decode steps) the shared expert runs inside the routed experts' grouped
# GEMM (`MoE.num_folded`): fewer launches, and no cuBLAS split-K at a few rows. Larger batches keep
# cuBLAS for it. H200, Nemotron-3-Nano's MoE layer graphed (bench_moe): folded 74 / 244 / 615 us
# at 1 / 8 / 64 tokens against 84 / 257 / 608 us unfolded.
FOLD_SHARED_MAX_TOKENS = 32


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(relu_square(self.up_proj(x)))


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
        # The one-launch decode routing's arrival counter per device: not a buffer, so that no
        # `.to()`, cast or meta-device build leaves it anything but zero.
        self._arrivals: dict[torch.device, torch.Tensor] = {}

    @property
    def route_args(self) -> tuple[int, int, int, bool, float]:
        """(top_k, n_group, topk_group, norm_topk_prob, scaling): what every routing function takes."""
        return self.top_k, self.n_group, self.topk_group, self.norm_topk_prob, self.scaling

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, E) router logits in the router dtype (``ops.moe.router_logits``)."""
        return router_logits(x, self.weight)

    def forward(self, x: torch.Tensor, always: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> expert ids (T, top_k), weights (T, top_k) in the router dtype; with
        `always` = S > 0 (Triton only), each token's row ends with experts E .. E + S - 1 at weight 1.

        Ids are int64 from the reference, int32 from the Triton kernel (CUDA, router in fp32)."""
        return topk_route(self.logits(x), self.e_score_correction_bias, *self.route_args, always=always)

    def route_aligned(self, x: torch.Tensor, always: int, block_m: int
                      ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Triton only: ``forward``'s ids and weights, and the pairs aligned by expert over the E + S
        experts in blocks of `block_m` (``align_by_expert``). Decode-sized batches take one launch
        for the logits, the routing and the alignment (``logits_route_align_triton``)."""
        from replayserve.ops import moe_route_triton as route
        from replayserve.ops.moe_align_triton import ALIGN_IN_ONE_PROGRAM

        num_tokens = x.shape[0]
        if (self.weight.dtype == torch.float32 and 0 < num_tokens <= ROUTER_KERNEL_MAX_TOKENS
                and num_tokens * (self.top_k + always) <= ALIGN_IN_ONE_PROGRAM):
            arrivals = self._arrivals.get(x.device)
            if arrivals is None:  # made on the first (eager, warm-up) call, outside any graph capture
                arrivals = self._arrivals[x.device] = route.arrivals_counter(x.device)
            return route.logits_route_align_triton(x, self.weight, arrivals, self.e_score_correction_bias,
                                                   *self.route_args, block_m=block_m, always=always)
        return route.route_and_align_triton(self.logits(x), self.e_score_correction_bias, *self.route_args,
                                            block_m=block_m, always=always)


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
            self.fc1_latent_proj = Linear(cfg.hidden_size, cfg.moe_latent_size, bias=cfg.mlp_bias)
            self.fc2_latent_proj = Linear(cfg.moe_latent_size, cfg.hidden_size, bias=cfg.mlp_bias)
        # The shared expert as S pseudo-experts of the routed width that every token takes with
        # weight 1 (relu^2 is elementwise, so its I_s = S * I columns split into S experts whose
        # outputs sum to it): small batches then run every expert in one grouped GEMM. Needs the
        # routed experts' input (no latent projection), no bias, and I_s a multiple of I.
        shared, inner = cfg.moe_shared_expert_intermediate_size, cfg.moe_intermediate_size
        foldable = cfg.moe_latent_size is None and not cfg.mlp_bias and shared and shared % inner == 0
        self.num_folded = shared // inner if foldable else 0
        self._scales: tuple[torch.Tensor, torch.Tensor] | None = None

    def stacked_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights as (E + S, I, W) up and (E + S, W, I) down projections: the E routed
        experts, then the shared expert's S = `num_folded` pseudo-experts (S = 0 when not foldable).
        16-bit, or float8_e4m3fn when the experts are `FP8Linear`s (an FP8 checkpoint's): their
        per-expert scales are then stacked too (`expert_scales`).

        Every parameter (`experts.{e}.up_proj.weight`, `shared_experts.down_proj.weight`: the
        checkpoint's names) and every FP8 scale buffer (`experts.{e}.up_proj.weight_scale`) is made
        a view of its slice, so the stacks cost no memory of their own and a load's in-place copies
        land in them. The down stack is stored (W, E + S, I) and returned permuted: the shared
        expert's (W, S * I) down projection is then one view of it.
        Restacked where the parameters stopped being those views (moved by `.to()`, cast, FP8
        modules swapped in): the models' `cast_` stacks at build time, so a forward only compares
        the first and the last parameter's address with the stacks' (all of them would cost ~1 ms
        of module lookups per layer and call, which eager prefill pays; one parameter replaced
        alone is not noticed)."""
        num, folded = len(self.experts), self.num_folded
        first = self.experts[0].up_proj.weight
        last = (self.shared_experts if folded else self.experts[-1]).down_proj.weight
        stacked = getattr(self, "_stacked", None)
        if stacked is not None and first.data_ptr() == stacked[0].data_ptr() and last.data_ptr() == (
                stacked[1][num] if folded else stacked[1][-1]).data_ptr():
            return stacked
        ups = [m.up_proj.weight for m in self.experts]
        downs = [m.down_proj.weight for m in self.experts]
        if len({w.dtype for w in ups + downs}) != 1:
            raise ValueError(f"the routed experts' weights must share one dtype to be stacked, got "
                             f"{sorted({str(w.dtype) for w in ups + downs})}")
        inner, width = ups[0].shape
        if folded:  # the shared expert's (S * I, W) up rows and (W, S * I) down columns: S experts' worth
            ups, downs = ups + [self.shared_experts.up_proj.weight], downs + [self.shared_experts.down_proj.weight]
        w_up = stack_as_views_(ups).view(num + folded, inner, width)
        # (E + S, W, I) of a (W, E + S, I) store, stacked by columns
        w_down = stack_as_views_(downs, dim=1).view(width, num + folded, inner).permute(1, 0, 2)
        self._scales = self._stack_scales() if isinstance(self.experts[0].up_proj, FP8Linear) else None
        self._stacked = (w_up, w_down)
        return self._stacked

    def _stack_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(up, down) weight scales of the FP8 experts, each (E,) float32, or (E + 1,) with the
        folded shared expert's one scale last (its S pieces share it: ``ops.moe.expert_scale``);
        each module's `weight_scale` buffer becomes a view of its entry."""
        mlps = [*self.experts, *([self.shared_experts] if self.num_folded else [])]
        return stack_scales_([(m.up_proj,) for m in mlps]), stack_scales_([(m.down_proj,) for m in mlps])

    def expert_scales(self, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The FP8 stacks' (up, down) per-expert scales for the first `count` experts of the stacks
        (E, or E + S with the shared expert folded), as ``fused_moe_triton`` and ``fused_moe_ref``
        take them; None for 16-bit experts. Call after `stacked_experts`."""
        if self._scales is None:
            return None
        up, down = self._scales
        return up[:count], down[:count]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). On CUDA (fp32, bf16, fp16) the routed experts run as Triton
        kernels without a host sync (CUDA-graph safe), with the shared expert folded in for up to
        FOLD_SHARED_MAX_TOKENS tokens; elsewhere as the per-expert reference loop. FP8 experts
        stay FP8 on both paths (dequantized in the kernel, or per expert by the reference)."""
        num = len(self.experts)
        w_up, w_down = self.stacked_experts()
        if use_triton(x):  # the grouped GEMM and its aligned routing: a composition of kernels only
            from replayserve.ops.moe_triton import config_for, fused_moe_triton

            folded = self.num_folded if x.shape[0] <= FOLD_SHARED_MAX_TOKENS else 0
            config = config_for(x, w_up, w_down, x.shape[0] * (self.gate.top_k + folded), num + folded)
            ids, weights, aligned = self.gate.route_aligned(x, folded, config.block_m)
            kw = dict(config=config, aligned=aligned)
            if folded:
                return fused_moe_triton(x, w_up, w_down, ids, weights, scales=self.expert_scales(num + 1), **kw)
            kw["scales"] = self.expert_scales(num)
            routed_in, shared = self.fc1_latent_proj(x), self.shared_experts(x)
            if isinstance(self.fc2_latent_proj, nn.Identity):  # the shared expert added in the same kernel
                return fused_moe_triton(routed_in, w_up[:num], w_down[:num], ids, weights, add=shared, **kw)
            return self.fc2_latent_proj(fused_moe_triton(routed_in, w_up[:num], w_down[:num], ids, weights, **kw)
                                        ) + shared
        ids, weights = self.gate(x)
        routed = fused_moe_ref(self.fc1_latent_proj(x), w_up[:num], w_down[:num], ids, weights,
                               scales=self.expert_scales(num))
        return self.fc2_latent_proj(routed.to(x.dtype)) + self.shared_experts(x)
