"""Nemotron-H attention (no positional encoding) over the paged KV cache.

Steps of uniform decode rows take fixed-shape paths (CUDA graphs: ``write_kv_and_attend_decode``);
every other step (prefill chunks, mixed prefill and decode) runs ``write_kv_and_attend``, the
Triton varlen kernel in one launch for the whole batch where it serves and the reference
elsewhere (the CPU, float64: the tests' oracle).
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.stacked import StackedProjection
from replayserve.layers.step_context import StepContext
from replayserve.ops.attention import write_kv_and_attend, write_kv_and_attend_decode
from replayserve.ops.rope import apply_rope_qk, rope_cos_sin_ref, rope_inv_freq


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5 if cfg.attention_multiplier is None else cfg.attention_multiplier
        # RoPE where the config sets rope_theta (Granite 4.0-H with position_embedding_type rope); else NoPE.
        self.rope = (int(cfg.head_dim * cfg.partial_rotary_factor), cfg.rope_theta) if cfg.rope_theta else None
        self._inv_freq_on: dict[torch.device, torch.Tensor] = {}
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # An FP8 KV cache's per-tensor scales: an FP8 checkpoint's k_scale / v_scale (models/fp8_loading.py)
        self.kv_scales = (1.0, 1.0)
        self._qkv: StackedProjection | None = None

    def stack_projections_(self) -> None:
        """q, k and v as one projection (`layers/stacked.py`), once the weights are final."""
        qkv = StackedProjection(self.q_proj, self.k_proj, self.v_proj)
        self._qkv = qkv if qkv.stack_() else None

    def forward(
        self, hidden: torch.Tensor, ctx: StepContext, kv_cache: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """hidden (T, hidden_size); kv_cache: K and V (num_blocks, block_size, Hkv, Dh)."""
        t = hidden.shape[0]
        if self._qkv is not None:
            q, k, v = self._qkv(hidden)
        else:
            q, k, v = self.q_proj(hidden), self.k_proj(hidden), self.v_proj(hidden)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self.o_proj(self.attend(q, k, v, ctx, kv_cache).reshape(t, -1))

    def rope_inv_freq(self, device: torch.device) -> torch.Tensor:
        """The layer's RoPE inverse frequencies (`ops.rope.rope_inv_freq`) on `device`, made once.
        Kept here, not as a buffer, which the loader's meta-device build would leave uninitialised
        and a cast would round. Not kept when first made inside a CUDA-graph capture (its memory
        would belong to the graph's pool)."""
        assert self.rope is not None
        inv_freq = self._inv_freq_on.get(device)
        if inv_freq is None:
            inv_freq = rope_inv_freq(*self.rope, device=device)
            if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
                self._inv_freq_on[device] = inv_freq
        return inv_freq

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext,
               kv_cache: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """RoPE (where the config sets it), the KV cache write and attention over the cache:
        q (T, H, Dh), k and v (T, Hkv, Dh) -> (T, H, Dh)."""
        if self.rope is not None:
            inv_freq = self.rope_inv_freq(q.device)
            key = (*self.rope, q.dtype)

            def cos_sin() -> tuple[torch.Tensor, torch.Tensor]:
                """The step's tables, made once: every attention layer rotates by the same angles."""
                if key not in ctx.rope_tables:
                    ctx.rope_tables[key] = rope_cos_sin_ref(ctx.positions, inv_freq, q.dtype)
                return ctx.rope_tables[key]

            q, k = apply_rope_qk(q, k, ctx.positions, inv_freq, cos_sin)
        k_cache, v_cache = kv_cache
        if ctx.uniform_decode:  # fixed shapes, no host sync: the CUDA-graph path
            return write_kv_and_attend_decode(q, k, v, k_cache, v_cache, ctx.slot_mapping, ctx.block_tables,
                                              ctx.query_start_loc, ctx.seq_lens, self.scale, ctx.uniform_decode,
                                              *self.kv_scales)
        return write_kv_and_attend(q, k, v, k_cache, v_cache, ctx.slot_mapping, ctx.block_tables,
                                   ctx.query_start_loc, ctx.seq_lens, self.scale, *self.kv_scales)
