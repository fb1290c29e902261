"""The SwiGLU feed-forward layers of Granite 4.0-H (the shared MLP every layer has and the
softmax-routed MoE beside it; `input_linear` holds gate and up), Bamba and Falcon-H1 (three projections),
with the parameter names of their checkpoints."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear

# Up to this many tokens the CUDA path runs every expert densely (graph-safe; E / top_k times the
# routed FLOPs, which decode batches afford); grouped SwiGLU expert kernels are not written yet.
DENSE_MAX_TOKENS = 256


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
        """x (T, hidden) -> (T, hidden). On the CPU, and on CUDA above DENSE_MAX_TOKENS tokens, the
        per-expert loop transformers runs (it reads the chosen experts back to the host); on CUDA up
        to DENSE_MAX_TOKENS tokens (decode steps) and in any CUDA-graph capture, every expert on every
        token with the unchosen ones weighted 0: no host sync, so CUDA graphs capture it."""
        logits = F.linear(x, self.router.layer.weight).float()
        top_logits, top_ids = logits.topk(self.top_k, dim=-1)
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        if x.is_cuda and (x.shape[0] <= DENSE_MAX_TOKENS or torch.cuda.is_current_stream_capturing()):
            dense = torch.zeros_like(logits, dtype=x.dtype).scatter_(1, top_ids, weights)  # (T, E)
            gate, up = torch.matmul(x, self.input_linear.weight.transpose(1, 2)).chunk(2, dim=-1)  # (E, T, I)
            y = torch.matmul(F.silu(gate) * up, self.output_linear.weight.transpose(1, 2))  # (E, T, hidden)
            return (y * dense.t()[:, :, None]).sum(0)
        out = torch.zeros_like(x)
        for expert in top_ids.unique().tolist():
            token, slot = torch.where(top_ids == expert)
            gate, up = F.linear(x[token], self.input_linear.weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.output_linear.weight[expert]) * weights[token, slot, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class SwiGLUMLP(nn.Module):
    """Bamba's and Falcon-H1's MLP: down(up(x) * silu(gate(x) * gate_multiplier)) * down_multiplier,
    three projections (the multipliers are Falcon-H1's `mlp_multipliers`; 1 for Bamba)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool,
                 multipliers: tuple[float, ...] = ()) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self.gate_multiplier, self.down_multiplier = multipliers or (1.0, 1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = self.down_proj(self.up_proj(x) * F.silu(gate))
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier
