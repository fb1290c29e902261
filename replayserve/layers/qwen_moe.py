"""The feed-forward MoE of Qwen3-Next and Qwen3.5-MoE, with its checkpoints' parameter names: top-k
experts of the router's softmax over all experts (renormalized over the k when `norm_topk_prob`),
SwiGLU experts, and a shared expert whose output is scaled by sigmoid(x @ shared_expert_gate).

Once the weights are final (`prepare_weights_`, after a load) the experts are stacked: every
`experts.{e}.gate_proj` / `up_proj` weight becomes a view of one (E, 2I, W) tensor (expert e's gate
rows, then its up rows: the grouped GEMM's SwiGLU layout) and every `down_proj` one of an (E, W, I)
tensor, so the state dict, the writer and in-place loads see the checkpoint's per-expert names. FP8
experts (`FP8Linear`s) stack their codes alike, each expert's gate and up first requantized to one
shared scale, with (E,) stacks of their scales (`layers/fp8_expert_stacks.py`). The
four projections of the block's input (the router, the shared expert's gate scalar, its gate and its
up) become one stacked projection (`layers/stacked.py`). Stacking happens then and never in a
forward: a CUDA graph captures the stacks' addresses.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.fp8_expert_stacks import fp8_stackable, share_scale_, stack_scales_
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.linear import Linear
from replayserve.layers.stacked import StackedProjection, stack_as_views_, stackable
from replayserve.ops.activation import silu_mul
from replayserve.ops.moe import softmax_all_topk_route_ref
from replayserve.ops.moe_softmax import softmax_moe


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size, bias=False)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, bias=False)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)
        self._inputs: StackedProjection | None = None
        self._experts: tuple[torch.Tensor, torch.Tensor] | None = None
        self._scales: tuple[torch.Tensor, torch.Tensor] | None = None  # (E,) up and down, FP8 experts'

    def stack_projections_(self) -> None:
        """Stacks the experts (E, 2I, W) / (E, W, I) and the input's four projections, once the
        weights are final (the module docstring). Experts that cannot stack (not all plain `Linear`s
        or all `FP8Linear`s of one dtype and device) stay apart: the forward then runs them one by
        one, with a host sync. FP8 experts' gate and up are requantized to one scale first."""
        # Made here, not at construction: an FP8 load swaps modules in after that.
        self._inputs = StackedProjection(self.gate, self.shared_expert_gate, self.shared_expert.gate_proj,
                                         self.shared_expert.up_proj)
        self._inputs.stack_()
        # Expert e's gate rows then its up rows, expert after expert: the (E, 2I, W) stack by rows.
        gate_ups = [proj for m in self.experts for proj in (m.gate_proj, m.up_proj)]
        downs = [m.down_proj for m in self.experts]
        up, down = gate_ups[0].weight, downs[0].weight
        fp8 = fp8_stackable(gate_ups) and fp8_stackable(downs)
        same_kind = (up.dtype, up.device) == (down.dtype, down.device)
        if not (same_kind and (fp8 or (stackable(gate_ups) and stackable(downs)))):
            return
        if fp8:  # the grouped GEMM scales an expert's (2I, W) block by one number
            for m in self.experts:
                share_scale_((m.gate_proj, m.up_proj))
            self._scales = (stack_scales_([(m.gate_proj, m.up_proj) for m in self.experts]),
                            stack_scales_([(m.down_proj,) for m in self.experts]))
        inner, width = up.shape
        w_up = stack_as_views_([m.weight for m in gate_ups]).view(len(self.experts), 2 * inner, width)
        w_down = stack_as_views_([m.weight for m in downs]).view(len(self.experts), width, inner)
        self._experts = (w_up, w_down)

    def expert_stacks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(w_up (E, 2I, W), w_down (E, W, I)) while the first and last experts' weights are still
        views of them; None before `stack_projections_`, for experts that could not stack, or once
        the parameters were moved, cast or replaced."""
        if self._experts is None:
            return None
        w_up, w_down = self._experts
        if (self.experts[0].gate_proj.weight.data_ptr() != w_up.data_ptr()
                or self.experts[-1].down_proj.weight.data_ptr() != w_down[-1].data_ptr()):
            return None
        return self._experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). With the experts stacked, `ops.moe_softmax.softmax_moe` (on
        CUDA the routing kernels and the grouped-GEMM SwiGLU experts, FP8 ones with their per-expert
        scales, the gated shared expert summed in their last kernel, CUDA-graph safe; elsewhere the
        references); experts that could not stack run one by one after the reference routing, with a
        host sync."""
        projections = (self._inputs or StackedProjection(self.gate, self.shared_expert_gate,
                                                         self.shared_expert.gate_proj, self.shared_expert.up_proj))
        logits, shared_gate, gate, up = projections(x)  # the logits in x's dtype, as transformers computes them
        shared = torch.sigmoid(shared_gate) * self.shared_expert.down_proj(silu_mul(gate, up))
        stacks = self.expert_stacks()
        if stacks is not None:
            return softmax_moe(x, logits, *stacks, self.top_k, self.norm_topk_prob, add=shared, softmax_first=True,
                               scales=self._scales)
        ids, weights = softmax_all_topk_route_ref(logits, self.top_k, self.norm_topk_prob)
        weights = weights.to(x.dtype)
        routed = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = torch.where(ids == e)
            routed.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return routed + shared
