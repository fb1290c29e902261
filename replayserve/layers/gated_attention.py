"""Qwen3-Next's and Qwen3.5's attention: q/k RMS norms per head, partial RoPE, and a sigmoid gate on
the output. `q_proj` yields each head's query and then its gate ([q (Dh), gate (Dh)] per head);
the norms are zero-centered, (1 + weight), as the models' other norms. The KV cache and attention
are `Attention`'s (paged, with the same kernels)."""

from __future__ import annotations

import torch

from replayserve.config import ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.linear import Linear
from replayserve.layers.norm import ZeroCenteredRMSNorm
from replayserve.layers.step_context import StepContext


class GatedAttention(Attention):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.q_proj = Linear(cfg.hidden_size, 2 * self.num_heads * self.head_dim, bias=False)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.layer_norm_epsilon)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, cfg.layer_norm_epsilon)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """hidden (T, hidden_size); kv_cache: K and V (num_blocks, block_size, Hkv, Dh)."""
        t = hidden.shape[0]
        q, gate = self.q_proj(hidden).view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim))
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        out = self.attend(q, k, v, ctx, kv_cache).reshape(t, -1)
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))
