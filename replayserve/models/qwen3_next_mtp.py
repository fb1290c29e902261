"""Qwen3-Next / Qwen3.5 multi-token prediction (MTP) layer, with the checkpoints' names (`mtp.*`).

transformers has no MTP for these families; the structure is the one public engines load from
the published checkpoints (vLLM's `qwen3_next_mtp.py`, SGLang and LightLLM read the same names):
``fc(cat(pre_fc_norm_embedding(embed), pre_fc_norm_hidden(hidden)))`` (2 * hidden -> hidden, the
embedding half first), then one decoder layer of gated attention and the family's feed-forward
(MoE where the model has experts, else the dense MLP) under the model's own names
(`mtp.layers.0.{input_layernorm,self_attn,post_attention_layernorm,mlp}`), then `mtp.norm`. Every
norm is zero-centered, (1 + weight), as the model's others; the token embedding and the LM head are
the target's. config.json declares it with `mtp_num_hidden_layers: 1`.

The interface is `NemotronHMTP`'s, so `MTPProposer` and `greedy_drafts` run either. RoPE rotates by
a position's column in the window: attention scores depend on position differences alone, which
every row keeps, so the target's absolute positions are not needed.
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
from replayserve.models.nemotron_h_mtp import MTPCache
from replayserve.ops.rope import apply_rope_ref, rope_inv_freq


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
        positions, no cache. Returns (L, hidden) after `norm`, row i predicting token i + 2; with
        `last_only` the last row alone, (1, hidden) (attention from the last query only)."""
        valid = torch.ones(1, embeds.shape[0], dtype=torch.bool, device=embeds.device)
        out, _ = self._run(embeds[None], hidden[None], valid, None, last_only)
        return out[0]

    def forward_padded(self, embeds: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor,
                       cache: MTPCache | None = None) -> tuple[torch.Tensor, MTPCache]:
        """`forward(..., last_only=True)` for a batch of left-padded rows, with a cache of the
        positions already run (`NemotronHMTP.forward_padded`'s contract). embeds, hidden
        (B, T, hidden); valid (B, T) bool. Returns (B, hidden) after `norm` and the extended cache."""
        out, cache = self._run(embeds, hidden, valid, cache, True)
        return out[:, -1], cache

    def _run(self, embeds: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor, cache: MTPCache | None,
             last_only: bool) -> tuple[torch.Tensor, MTPCache]:
        """(B, T, hidden) inputs -> (B, T or 1, hidden) outputs after `norm`, and the cache."""
        key_valid = valid if cache is None else torch.cat([cache.valid, valid], dim=1)
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        layer = self.layers[0]
        past = None if cache is None else (cache.keys[0], cache.values[0])
        out, k, v = _gated_attention(layer.self_attn, layer.input_layernorm(x), key_valid, past, last_only)
        x = (x[:, -1:] if last_only else x) + out
        x = x + layer.mlp(layer.post_attention_layernorm(x).flatten(0, 1)).view_as(x)
        return self.norm(x), MTPCache([k], [v], key_valid)


def _gated_attention(attn: GatedAttention, hidden: torch.Tensor, key_valid: torch.Tensor,
                     past: tuple[torch.Tensor, torch.Tensor] | None,
                     last_query_only: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`GatedAttention` over left-padded rows without the paged cache: hidden (B, T, hidden) new
    positions after the `past` keys and values (B, Hkv, P, Dh, RoPE applied); key_valid (B, P + T)
    bool. A padding position attends to itself alone, so its row stays finite (as in
    `nemotron_h_mtp._padded_attention`). Returns the output (B, T or 1, hidden) and the keys and
    values (B, Hkv, P + T, Dh)."""
    b, t, _ = hidden.shape
    queries = hidden[:, -1:] if last_query_only else hidden
    tq = queries.shape[1]
    q, gate = attn.q_proj(queries).view(b, tq, attn.num_heads, 2 * attn.head_dim).chunk(2, dim=-1)
    q = attn.q_norm(q)
    k = attn.k_norm(attn.k_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim))
    v = attn.v_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    start = 0 if past is None else past[0].shape[2]
    total = start + t
    key_pos = torch.arange(total, device=hidden.device)
    if attn.rope is not None:
        inv_freq = rope_inv_freq(*attn.rope, device=hidden.device)
        q = apply_rope_ref(q.flatten(0, 1), key_pos[total - tq :].repeat(b), inv_freq).view_as(q)
        k = apply_rope_ref(k.flatten(0, 1), key_pos[start:].repeat(b), inv_freq).view_as(k)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    query_pos = key_pos[total - tq :, None]
    mask = (key_pos <= query_pos) & (key_valid[:, None, :] | (key_pos == query_pos))  # (B, tq, total)
    group = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                         attn_mask=mask[:, None], scale=attn.scale)
    out = out.transpose(1, 2).reshape(b, tq, -1)
    return attn.o_proj(out * torch.sigmoid(gate.reshape(b, tq, -1))), k, v
