"""The SwiGLU feed-forward layers of Granite 4.0-H (the shared MLP every layer has and the
softmax-routed MoE beside it; `input_linear` holds gate and up) and Bamba (three projections),
with the parameter names of their checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear


class SharedMLP(nn.Module):
    """silu(gate) * up, gate and up the two halves of `input_linear`'s output."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


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
    """Top-k experts by router logit, weighted by the softmax over the chosen k (float32)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        num, inner = cfg.n_routed_experts, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.router = Router(cfg.hidden_size, num)
        self.input_linear = ExpertWeights(num, 2 * inner, cfg.hidden_size)
        self.output_linear = ExpertWeights(num, cfg.hidden_size, inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). The per-expert reference loop: it reads the chosen experts
        back to the host, so it is not CUDA-graph safe."""
        logits = F.linear(x, self.router.layer.weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        out = torch.zeros_like(x)
        for expert in top_ids.unique().tolist():
            token, slot = torch.where(top_ids == expert)
            gate, up = F.linear(x[token], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SwiGLUMLP(nn.Module):
    """Bamba's MLP: down(silu(gate(x)) * up(x)), three projections."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
