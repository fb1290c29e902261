"""Nemotron-H attention (no positional encoding) over the paged KV cache."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.step_context import StepContext
from replayserve.ops.attention import (
    decode_attention_dense,
    paged_attention_ref,
    write_kv_cache_dense,
    write_kv_cache_ref,
)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """hidden (T, hidden_size); kv_cache: K and V (num_blocks, block_size, Hkv, Dh)."""
        t = hidden.shape[0]
        q = self.q_proj(hidden).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(t, self.num_kv_heads, self.head_dim)
        k_cache, v_cache = kv_cache
        if ctx.uniform_decode:  # fixed shapes, no host sync: the CUDA-graph path
            if q.is_cuda:  # Triton: reads each row's context only, not its whole block table
                from replayserve.ops.paged_attention_triton import (
                    paged_decode_attention_triton,
                    write_kv_cache_triton,
                )

                write_kv_cache_triton(k, v, k_cache, v_cache, ctx.slot_mapping)
                out = paged_decode_attention_triton(q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc,
                                                    ctx.seq_lens, self.scale, max_query_len=ctx.uniform_decode)
            else:
                write_kv_cache_dense(k, v, k_cache, v_cache, ctx.slot_mapping)
                out = decode_attention_dense(q, k_cache, v_cache, ctx.block_tables, ctx.seq_lens, self.scale)
            return self.o_proj(out.reshape(t, -1))
        write_kv_cache_ref(k, v, k_cache, v_cache, ctx.slot_mapping)
        out = paged_attention_ref(
            q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc, ctx.seq_lens, self.scale
        )
        return self.o_proj(out.reshape(t, -1))
