"""Nemotron-H attention (no positional encoding) over the paged KV cache.

Steps of uniform decode rows take fixed-shape paths (CUDA graphs): the Triton decode kernel on
CUDA, the dense op elsewhere. Every other step (prefill chunks, mixed prefill and decode) runs the
Triton varlen kernel on CUDA for fp32/bf16/fp16 and power-of-two head_dim, one launch for the whole
batch, and ``paged_attention_ref`` elsewhere: the CPU, other dtypes (float64, the tests' oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.step_context import StepContext
from replayserve.ops.attention import (
    decode_attention_dense,
    paged_attention_ref,
    prefill_kernel_head_dim,
    write_kv_cache_dense,
    write_kv_cache_ref,
)
from replayserve.ops.dtypes import triton_ok


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        self.prefill_kernel_fits = prefill_kernel_head_dim(cfg.head_dim)
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)

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
        if triton_ok(q) and self.prefill_kernel_fits:  # no host sync, no scores in memory
            from replayserve.ops.paged_attention_triton import write_kv_cache_triton
            from replayserve.ops.prefill_attention_triton import paged_prefill_attention_triton

            write_kv_cache_triton(k, v, k_cache, v_cache, ctx.slot_mapping)
            out = paged_prefill_attention_triton(q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc,
                                                 ctx.seq_lens, self.scale)
        else:
            write_kv_cache_ref(k, v, k_cache, v_cache, ctx.slot_mapping)
            out = paged_attention_ref(
                q, k_cache, v_cache, ctx.block_tables, ctx.query_start_loc, ctx.seq_lens, self.scale
            )
        return self.o_proj(out.reshape(t, -1))
