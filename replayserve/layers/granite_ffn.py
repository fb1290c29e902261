"""The SwiGLU feed-forward layers of Granite 4.0-H (the shared MLP every layer has and the
softmax-routed MoE beside it; `input_linear` holds gate and up), Bamba and Falcon-H1 (three projections),
with the parameter names of their checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.stacked import StackedProjection
from replayserve.ops.activation import silu_mul
from replayserve.ops.moe_softmax import softmax_moe


class SharedMLP(nn.Module):
    """silu(gate) * up, gate and up the two halves of `input_linear`'s output."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(silu_mul(gate, up))


class ExpertWeights(nn.Module):
    """(E, out, in) stacked expert weights under the checkpoint's `<name>.weight`."""

    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.layer = Linear(hidden_size, num_experts, bias=False)


class SoftmaxMoE(nn.Module):
    """Top-k experts by router logit, weighted by the softmax over the chosen k (float32, then cast to
    x's dtype: transformers' GraniteMoeHybridTopKGating), SwiGLU experts."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        num, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.router = Router(cfg.hidden_size, num)
        self.input_linear = ExpertWeights(num, 2 * inner, cfg.hidden_size)
        self.output_linear = ExpertWeights(num, cfg.hidden_size, inner)

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden), plus `add` (the shared MLP's output) when given:
        `ops.moe_softmax.softmax_moe` (on CUDA the grouped-GEMM Triton experts, `add` summed in their
        last kernel, CUDA-graph safe; elsewhere the per-expert reference)."""
        logits = F.linear(x, self.router.layer.weight)  # in x's dtype, as transformers computes them
        return softmax_moe(x, logits, self.input_linear.weight, self.output_linear.weight, self.top_k, add=add)


class SwiGLUMLP(nn.Module):
    """Bamba's, Falcon-H1's and the Qwen experts' MLP: down(up(x) * silu(gate(x))), three projections
    (Falcon-H1's `mlp_multipliers` are folded into gate_proj and down_proj: `layers/fold.py`)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self._gate_up: StackedProjection | None = None

    def stack_projections_(self) -> None:
        """gate and up as one projection (`layers/stacked.py`), once the weights are final."""
        gate_up = StackedProjection(self.gate_proj, self.up_proj)
        self._gate_up = gate_up if gate_up.stack_() else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._gate_up(x) if self._gate_up is not None else (self.gate_proj(x), self.up_proj(x))
        return self.down_proj(silu_mul(gate, up))
