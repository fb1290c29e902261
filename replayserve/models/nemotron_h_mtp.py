"""Nemotron-H multi-token prediction (MTP) layers, with the checkpoint's names (`mtp.layers.{i}.*`).

Layout as public engines load it: one stack of attention / MoE / MLP blocks; the first block
fuses the embedding of the next token with the target's final hidden state,
``eh_proj(cat(enorm(embed), hnorm(hidden)))``; the last ends in ``final_layernorm``; the token
embedding and the LM head are the target's.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ATTENTION, MOE, ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.linear import Linear
from replayserve.layers.mlp import MLP, MoE
from replayserve.layers.norm import RMSNorm
from replayserve.models.mtp_kv import MTPKV, MTPCall, cached_attention, write_kv
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

    def forward_cached(self, embeds: torch.Tensor, hidden: torch.Tensor, kv: MTPKV, call: MTPCall,
                       output: bool = True) -> torch.Tensor | None:
        """`forward(..., last_only=True)` for a batch of rows, each over its T new positions (left-padded,
        `MTPCall`), attending to the keys and values `kv` keeps of its earlier positions; the new
        positions' keys and values are written there. embeds, hidden (B, T, hidden).

        Returns the last column's output (B, hidden) after final_layernorm; with `output` False, None
        once the last attention block has written its keys and values (a call that only fills the
        cache: nothing after that block reaches the cache)."""
        attends = [i for i, block in enumerate(self.layers) if block.block_type == ATTENTION]
        last_attention = attends[-1] if attends else -1
        if last_attention < 0:  # rows are independent throughout: the last position alone
            if not output:
                return None
            embeds, hidden = embeds[:, -1:], hidden[:, -1:]
        first = self.layers[0]
        x = first.eh_proj(torch.cat([first.enorm(embeds), first.hnorm(hidden)], dim=-1))
        for i, block in enumerate(self.layers):
            h = block.norm(x)
            if block.block_type == ATTENTION:
                last = i == last_attention  # every key, the last query only (or none)
                out = _cached_attention(block.mixer, h, kv, attends.index(i), call, queries=1 if last else None,
                                        output=output or not last)
                if out is None:
                    return None
                x = (x[:, -1:] if last else x) + out
            else:  # the MLP and MoE take (tokens, hidden)
                x = x + block.mixer(h.flatten(0, 1)).view_as(x)
        return self.layers[-1].final_layernorm(x[:, -1])


def _cached_attention(attn: Attention, hidden: torch.Tensor, kv: MTPKV, block: int, call: MTPCall,
                      queries: int | None, output: bool) -> torch.Tensor | None:
    """The attention mixer over a call's new positions hidden (B, T, hidden) against the cache
    (`mtp_kv.cached_attention`): the output of the last `queries` positions (all: None),
    (B, Tq, hidden); None without `output` (keys and values written only)."""
    b, t, _ = hidden.shape
    k = attn.k_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim)
    v = attn.v_proj(hidden).view(b, t, attn.num_kv_heads, attn.head_dim)
    write_kv(kv, block, call, k, v)
    if not output:
        return None
    tq = t if queries is None else queries
    q = attn.q_proj(hidden[:, t - tq :]).view(b, tq, attn.num_heads, attn.head_dim)
    out = cached_attention(q, kv, block, call, attn.scale)
    return attn.o_proj(out.reshape(b, tq, -1))


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
