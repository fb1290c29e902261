"""Nemotron-H multi-token prediction (MTP) layers, with the checkpoint's names (`mtp.layers.{i}.*`).

Layout as public engines load it: one stack of attention / MoE / MLP blocks; the first block
fuses the embedding of the next token with the target's final hidden state,
``eh_proj(cat(enorm(embed), hnorm(hidden)))``; the last ends in ``final_layernorm``; the token
embedding and the LM head are the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ATTENTION, MOE, ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.linear import Linear
from replayserve.layers.mlp import MLP, MoE
from replayserve.layers.norm import RMSNorm
from replayserve.ops.attention import paged_attention_ref


class MTPBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, block_type: str, first: bool, last: bool) -> None:
        super().__init__()
        self.block_type = block_type
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer: nn.Module
        if block_type == ATTENTION:
            self.mixer = Attention(cfg)
        elif block_type == MOE:
            self.mixer = MoE(cfg)
        else:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        if first:
            self.enorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
            self.hnorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
            self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        if last:
            self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


@dataclass
class MTPCache:
    """What `NemotronHMTP.forward_padded` keeps of the positions it has run, so a call for one more
    position per row computes that position alone: each attention block's keys and values
    (B, Hkv, P, Dh), and which of the P positions are real (B, P) bool (the rest is left padding)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    valid: torch.Tensor


class NemotronHMTP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = len(cfg.mtp_layer_types)
        self.layers = nn.ModuleList(MTPBlock(cfg, t, i == 0, i == n - 1) for i, t in enumerate(cfg.mtp_layer_types))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """embeds (L, hidden): embeddings of tokens i + 1; hidden (L, hidden): the hidden state that
        predicted them (the target's, or this module's own for chained drafts). Causal over the L
        positions, no cache. Returns (L, hidden) after final_layernorm: row i predicts token i + 2.

        last_only: return the last row alone, (1, hidden): what a proposer needs, at a fraction of
        the cost. Rows are independent after the last attention block, so that block attends from
        the last position only and the blocks after it (all of them when none attends) run on the
        last row."""
        attends = [i for i, block in enumerate(self.layers) if block.block_type == ATTENTION]
        last_attention = attends[-1] if attends else -1
        if last_only and last_attention < 0:
            embeds, hidden = embeds[-1:], hidden[-1:]
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        for i, block in enumerate(self.layers):
            h = block.norm(x)
            if block.block_type == ATTENTION:
                last = last_only and i == last_attention  # every key, the last query only
                x = (x[-1:] if last else x) + _causal_attention(block.mixer, h, last)
            else:
                x = x + block.mixer(h)
        return self.layers[-1].final_layernorm(x)

    def forward_padded(self, embeds: torch.Tensor, hidden: torch.Tensor, valid: torch.Tensor,
                       cache: MTPCache | None = None) -> tuple[torch.Tensor, MTPCache]:
        """`forward(..., last_only=True)` for a batch of rows at once, with a cache of the positions
        already run. embeds, hidden (B, T, hidden): T new positions per row, after the cached ones;
        valid (B, T) bool: which are real. Padding goes on the left, so every row's last position
        is real and new positions line up. Returns the last position's output (B, hidden) after
        final_layernorm, and the cache with the new positions appended.

        Causal attention makes a cached position's keys and values independent of what follows,
        so extending by one position gives what a forward over the whole row would."""
        attends = [i for i, block in enumerate(self.layers) if block.block_type == ATTENTION]
        last_attention = attends[-1] if attends else -1
        if last_attention < 0:  # rows are independent throughout: the last position alone
            embeds, hidden, valid = embeds[:, -1:], hidden[:, -1:], valid[:, -1:]
        key_valid = valid if cache is None else torch.cat([cache.valid, valid], dim=1)
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        keys: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, block in enumerate(self.layers):
            h = block.norm(x)
            if block.block_type == ATTENTION:
                past = None if cache is None else (cache.keys[len(keys)], cache.values[len(keys)])
                last = i == last_attention  # every key, the last query only
                out, k, v = _padded_attention(block.mixer, h, key_valid, past, last)
                x = (x[:, -1:] if last else x) + out
                keys.append(k)
                values.append(v)
            else:  # the MLP and MoE take (tokens, hidden)
                x = x + block.mixer(h.flatten(0, 1)).view_as(x)
        return self.layers[-1].final_layernorm(x[:, -1]), MTPCache(keys, values, key_valid)


def _padded_attention(attn: Attention, hidden: torch.Tensor, key_valid: torch.Tensor,
                      past: tuple[torch.Tensor, torch.Tensor] | None,
                      last_query_only: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention mixer over left-padded rows: hidden (B, T, hidden) new positions after the
    `past` keys and values (B, Hkv, P, Dh); key_valid (B, P + T) bool. A position attends causally
    to the real ones; a padding position to itself alone, so its row stays finite (a row of -inf
    scores would make NaN, which the next block's padded keys would carry into real rows).
    Returns the output (B, T or 1, hidden) and the keys and values (B, Hkv, P + T, Dh)."""
    b, t, _ = hidden.shape
    queries = hidden[:, -1:] if last_query_only else hidden
    tq = queries.shape[1]
    q = attn.q_proj(queries).view(b, tq, attn.num_heads, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim).transpose(1, 2)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
    total = k.shape[2]
    key_pos = torch.arange(total, device=hidden.device)
    query_pos = key_pos[total - tq :, None]
    mask = (key_pos <= query_pos) & (key_valid[:, None, :] | (key_pos == query_pos))  # (B, tq, total)
    group = attn.num_heads // attn.num_kv_heads
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                         attn_mask=mask[:, None], scale=attn.scale)
    return attn.o_proj(out.transpose(1, 2).reshape(b, tq, -1)), k, v


def _causal_attention(attn: Attention, hidden: torch.Tensor, last_query_only: bool = False) -> torch.Tensor:
    """The attention mixer over `hidden` alone: one sequence in a single block of its own length.
    Returns (L, hidden), or (1, hidden) for the last position with `last_query_only`."""
    t = hidden.shape[0]
    queries = hidden[-1:] if last_query_only else hidden
    q = attn.q_proj(queries).view(queries.shape[0], attn.num_heads, attn.head_dim)
    k = attn.k_proj(hidden).view(1, t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(hidden).view(1, t, attn.num_kv_heads, attn.head_dim)
    dev = hidden.device
    out = paged_attention_ref(q, k, v, torch.zeros(1, 1, dtype=torch.int64, device=dev),
                              torch.tensor([0, q.shape[0]], device=dev), torch.tensor([t], device=dev), attn.scale,
                              batch_decodes=False)
    return attn.o_proj(out.reshape(q.shape[0], -1))
