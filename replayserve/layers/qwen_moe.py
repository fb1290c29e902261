"""The feed-forward MoE of Qwen3-Next and Qwen3.5-MoE, with its checkpoints' parameter names: top-k
experts of the router's softmax (renormalized over the k when `norm_topk_prob`), SwiGLU experts,
and a shared expert whose output is scaled by sigmoid(x @ shared_expert_gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.linear import Linear
from replayserve.ops.dtypes import compute_dtype

# Up to this many tokens the CUDA path runs every expert densely (graph-safe; E / top_k times the
# routed FLOPs, which decode batches afford); its SwiGLU experts do not take the grouped GEMM yet.
DENSE_MAX_TOKENS = 256


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size, bias=False)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_expert = SwiGLUMLP(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, bias=False)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (T, hidden) -> expert ids (T, k) int64 and their weights (T, k) in x.dtype; the
        softmax in the compute dtype, as transformers computes it."""
        logits = F.linear(x, self.gate.weight)
        probs = torch.softmax(logits.to(compute_dtype(x.dtype)), dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (T, hidden) -> (T, hidden). On the CPU, and on CUDA above DENSE_MAX_TOKENS tokens, one
        pass per chosen expert over its tokens (it reads the chosen experts back to the host); on
        CUDA up to DENSE_MAX_TOKENS tokens and in any CUDA-graph capture, every expert on every token
        with the unchosen ones weighted 0: no host sync, so CUDA graphs capture it."""
        ids, weights = self.route(x)
        out = torch.zeros_like(x)
        if x.is_cuda and (x.shape[0] <= DENSE_MAX_TOKENS or torch.cuda.is_current_stream_capturing()):
            dense = torch.zeros(x.shape[0], len(self.experts), dtype=x.dtype, device=x.device)
            dense.scatter_(1, ids, weights)
            for e, expert in enumerate(self.experts):
                out = out + expert(x) * dense[:, e : e + 1]
        else:
            for e in ids.unique().tolist():
                token, slot = torch.where(ids == e)
                out.index_add_(0, token, self.experts[e](x[token]) * weights[token, slot, None])
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
