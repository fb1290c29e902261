"""Qwen3-Next / Qwen3.5 multi-token prediction (MTP) layer, with the checkpoints' names (`mtp.*`).

transformers has no MTP for these families; the structure is the one public engines load from
the published checkpoints (vLLM's `qwen3_next_mtp.py`, SGLang and LightLLM read the same names):
``fc(cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`` (2 * hidden -> hidden, the
embedding half first), then one decoder layer of gated attention and the family's feed-forward
(MoE where the model has experts, else the dense MLP) under the model's own names
(`mtp.layers.0.{input_layernorm,self_attn,post_attention_layernorm,mlp}`), then `mtp.norm`. Every
norm is zero-centered, (1 + weight), as the model's others; the token embedding and the LM head are
the target's. config.json declares it with `mtp_num_hidden_layers: 1`.

The interface is `NemotronHMTP`'s, so `MTPProposer` and `greedy_drafts` run either. The uncached
`forward` rotates by a position's index in its window, the cached path by its absolute position:
attention scores depend on position differences alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import MOE, ModelConfig
from replayserve.layers.gated_attention import GatedAttention
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.linear import Linear
from replayserve.layers.norm import ZeroCenteredRMSNorm
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.models.mtp_kv import MTPKV, MTPCall, cached_attention, write_kv
from replayserve.ops.rope import apply_rope_ref


class QwenMTPLayer(nn.Module):
    """The MTP's decoder layer: gated attention, then the feed-forward named by
    `cfg.mtp_layer_types[1]`, each behind a zero-centered norm and a residual add."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mlp = (SparseMoeBlock(cfg) if cfg.mtp_layer_types[-1] == MOE
                    else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, False))


class QwenMTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layers = nn.ModuleList([QwenMTPLayer(cfg)])
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """embeds (L, hidden): embeddings of tokens i + 1; hidden (L, hidden): the hidden state that
        predicted them (the target's, or this module's own for chained drafts). Causal over the L
        positions, no cache; RoPE by the row's index. Returns (L, hidden) after `norm`, row i
        predicting token i + 2; with `last_only` the last row alone, (1, hidden) (attention from the
        last query only)."""
        t = embeds.shape[0]
        x = self._fuse(embeds, hidden)
        layer = self.layers[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        positions = torch.arange(t, device=x.device)
        q, gate, k, v = _project(attn, h[-1:] if last_only else h, h, positions[-1:] if last_only else positions,
                                 positions)
        group = attn.num_heads // attn.num_kv_heads
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1).repeat_interleave(group, dim=0),
                                             v.transpose(0, 1).repeat_interleave(group, dim=0),
                                             attn_mask=positions[None, :] <= positions[-q.shape[0] :, None],
                                             scale=attn.scale).transpose(0, 1)
        x = (x[-1:] if last_only else x) + attn.o_proj(out.flatten(1) * torch.sigmoid(gate.flatten(1)))
        return self.norm(x + layer.mlp(layer.post_attention_layernorm(x)))

    def forward_cached(self, embeds: torch.Tensor, hidden: torch.Tensor, kv: MTPKV, call: MTPCall,
                       output: bool = True) -> torch.Tensor | None:
        """`NemotronHMTP.forward_cached`'s contract: embeds, hidden (B, T, hidden) of each row's T new
        positions (left-padded, `MTPCall`); RoPE by absolute position (scores depend on position
        differences alone, so they equal the uncached forward's). Returns (B, hidden) after `norm`, or
        None without `output` (keys and values written only)."""
        b, t, _ = embeds.shape
        x = self._fuse(embeds, hidden)
        layer = self.layers[0]
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        positions = call.positions(t)
        tq = 1 if output else 0
        q, gate, k, v = _project(attn, h[:, t - tq :].flatten(0, 1), h.flatten(0, 1),
                                 positions[:, t - tq :].flatten(), positions.flatten())
        write_kv(kv, 0, call, k.view(b, t, *k.shape[1:]), v.view(b, t, *v.shape[1:]))
        if not output:
            return None
        out = cached_attention(q.view(b, 1, *q.shape[1:]), kv, 0, call, attn.scale)
        x = x[:, -1] + attn.o_proj(out.flatten(1) * torch.sigmoid(gate.flatten(1)))
        return self.norm(x + layer.mlp(layer.post_attention_layernorm(x)))

    def _fuse(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))


def _project(attn: GatedAttention, queries: torch.Tensor, hidden: torch.Tensor, query_pos: torch.Tensor,
             key_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`GatedAttention`'s projections without the paged cache: queries (Tq, hidden) and hidden
    (T, hidden) positions at query_pos (Tq,) and key_pos (T,) int64. Returns q (Tq, H, Dh) and its
    gate (Tq, H, Dh), k and v (T, Hkv, Dh); q and k normed and rotated (where the layer has RoPE)."""
    q, gate = attn.q_proj(queries).view(-1, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
    q = attn.q_norm(q)
    k = attn.k_norm(attn.k_proj(hidden).view(-1, attn.num_kv_heads, attn.head_dim))
    v = attn.v_proj(hidden).view(-1, attn.num_kv_heads, attn.head_dim)
    if attn.rope is not None:
        inv_freq = attn.rope_inv_freq(hidden.device)
        q, k = apply_rope_ref(q, query_pos, inv_freq), apply_rope_ref(k, key_pos, inv_freq)
    return q, gate, k, v
