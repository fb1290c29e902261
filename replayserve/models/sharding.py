"""Which slice of the model one tensor-parallel rank holds, and how checkpoint tensors are cut to it.

Megatron-style: a mixer's input projections are column-parallel (each rank computes its heads or
inner channels), its output projection row-parallel (each rank's product is a partial sum, all-
reduced: `layers.all_reduce_output`). Attention splits its heads, and its KV heads unless there are
fewer than ranks (then each rank keeps the one its heads read); MLP and MoE experts split their
inner dimension (every rank routes every token; no expert parallelism); Mamba2 splits its heads,
with the B/C groups `MambaShard` derives; embedding and LM head split the vocabulary. Norms,
routers, the MoE latent projections and the MTP's eh_proj are replicated. A row-parallel bias is
kept on rank 0 alone, so the all-reduce adds it once. An FP8 checkpoint's codes are cut by the
same slicers; its per-tensor scales have none, so every rank keeps them whole.

The other Mamba2 hybrids use the same cuts: Granite 4.0-H's `input_linear` (gate and up stacked,
per expert too) keeps the rank's rows of each half. The multipliers (embedding, residual, logits,
muP) are folded into each rank's slice after it loads (`layers/fold.py`): scalars commute with the
sums, and Falcon-H1's per-section in_proj multipliers follow the rank's local z/x/B/C/dt sections,
which its mixer, built from the rank's config, sizes.

The Gated DeltaNet families (Qwen3-Next, Qwen3.5) split the GDN by key heads, each rank with the value
heads that read them (`_shard_gated_delta`), and their gated attention by heads (its q_proj rows hold
each head's query, then its gate); their MoE block adds its routed and shared experts' partial sums
(the shared one times its replicated sigmoid gate) and all-reduces once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.falcon_mamba import GateOnly
from replayserve.layers.gated_attention import GatedAttention
from replayserve.layers.gated_delta_net import GatedDeltaNet
from replayserve.layers.granite_ffn import SharedMLP, SoftmaxMoE, SwiGLUMLP
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.mlp import MLP, MoE
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.layers.tensor_parallel import (
    ParallelLMHead,
    ShardedGatedRMSNorm,
    VocabParallelEmbedding,
    all_reduce_output,
    vocab_rows,
)
from replayserve.ssm.layout import MambaShard

Slicer = Callable[[torch.Tensor], torch.Tensor]


def local_model_config(model: ModelConfig, rank: int, world: int) -> ModelConfig:
    """The config of a rank's slice: the model classes built from it have the rank's shapes (the
    vocabulary stays whole here; `RankShard.build` swaps in the vocab-parallel modules)."""
    mamba = MambaShard.of(model, rank, world)
    # Gated DeltaNet: whole key heads and the value heads that read them (GatedDeltaLayout follows)
    gdn = ({"linear_num_key_heads": model.linear_num_key_heads // world,
            "linear_num_value_heads": model.linear_num_value_heads // world} if model.num_gated_delta_layers else {})
    return dataclasses.replace(
        model, num_attention_heads=model.num_attention_heads // world,
        num_key_value_heads=max(1, model.num_key_value_heads // world),
        intermediate_size=model.intermediate_size // world, moe_intermediate_size=model.moe_intermediate_size // world,
        moe_shared_expert_intermediate_size=model.moe_shared_expert_intermediate_size // world,
        mamba_num_heads=mamba.num_heads, n_groups=mamba.num_groups, **gdn)


class RankShard:
    """One rank's slice of a model: `build` makes the module tree, `slice` cuts a checkpoint tensor."""

    def __init__(self, model: ModelConfig, rank: int, world: int) -> None:
        self.model, self.rank, self.world = model, rank, world
        self.mamba = MambaShard.of(model, rank, world)
        self._slicers: dict[str, Slicer] = {}
        self._summed_once: list[str] = []  # prefixes of modules whose inner partial sums are all-reduced once

    def build(self, model_class: type[nn.Module]) -> nn.Module:
        """The rank's model of `model_class` (the family's, `models/registry.py`; Nemotron-H's module
        tree) on the current default device (meta for the loader), its row-parallel projections
        all-reducing their outputs."""
        cfg = self.model
        net = model_class(local_model_config(cfg, self.rank, self.world))
        # Nemotron-H's `embeddings`, the other families' `embed_tokens`
        embedding = next(name for name, m in net.backbone.named_children() if isinstance(m, nn.Embedding))
        setattr(net.backbone, embedding, VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.rank, self.world))
        net.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.rank, self.world)
        if cfg.tie_word_embeddings:
            net.lm_head.weight = getattr(net.backbone, embedding).weight
        start, rows = vocab_rows(cfg.vocab_size, self.rank, self.world)
        self._slicers = {f"backbone.{embedding}.weight": _rows(start, rows), "lm_head.weight": _rows(start, rows)}
        for prefix, module in list(net.named_modules()):
            self._shard_module(prefix + ".", module)
        return net

    def slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The rank's part of checkpoint tensor `name` (the whole tensor where it is replicated)."""
        slicer = self._slicers.get(name)
        return tensor if slicer is None else slicer(tensor)

    def _shard_module(self, prefix: str, module: nn.Module) -> None:
        r, s = self.rank, self._slicers
        if isinstance(module, Attention):
            q, kv, dh = module.num_heads, module.num_kv_heads, module.head_dim
            kv_start = r * q // (self.model.num_attention_heads // self.model.num_key_value_heads)
            # The gated attention's q_proj holds [query (Dh), gate (Dh)] per head: 2 Dh rows a head.
            q_rows = 2 * dh if isinstance(module, GatedAttention) else dh
            s[prefix + "q_proj.weight"] = _rows(r * q * q_rows, q * q_rows)
            s[prefix + "k_proj.weight"] = s[prefix + "v_proj.weight"] = _rows(kv_start * dh, kv * dh)
            s[prefix + "o_proj.weight"] = _cols(r * q * dh, q * dh)
            module.o_proj.register_forward_hook(all_reduce_output)  # MTP calls o_proj directly
        elif isinstance(module, MLP):  # a block's MLP, a routed expert or the shared expert
            inner = module.up_proj.out_features
            s[prefix + "up_proj.weight"] = s[prefix + "up_proj.bias"] = _rows(r * inner, inner)
            s[prefix + "down_proj.weight"] = _cols(r * inner, inner)
            s[prefix + "down_proj.bias"] = self._first_rank_only
        elif isinstance(module, MoE):
            s[prefix + "fc2_latent_proj.bias"] = self._first_rank_only  # applied to the partial routed sum
        elif isinstance(module, Mamba2Mixer):
            self._shard_mamba(prefix, module)
            module.register_forward_hook(all_reduce_output)
        elif isinstance(module, GatedDeltaNet):
            self._shard_gated_delta(prefix, module)
            module.out_proj.register_forward_hook(all_reduce_output)
        elif isinstance(module, SparseMoeBlock):
            # Routed and shared experts (SwiGLUMLPs, cut below) each give a partial sum; the block
            # adds them (the shared one times its replicated sigmoid gate) before one all-reduce.
            self._summed_once.append(prefix)
            module.register_forward_hook(all_reduce_output)
        elif isinstance(module, SwiGLUMLP):
            inner = module.up_proj.out_features
            for name in ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias"):
                s[prefix + name] = _rows(r * inner, inner)
            s[prefix + "down_proj.weight"] = _cols(r * inner, inner)
            s[prefix + "down_proj.bias"] = self._first_rank_only
            if not any(prefix.startswith(outer) for outer in self._summed_once):
                module.register_forward_hook(all_reduce_output)
        elif isinstance(module, SharedMLP):
            inner = module.output_linear.in_features
            s[prefix + "input_linear.weight"] = _gate_up(r * inner, inner, self.world * inner, dim=0)
            s[prefix + "output_linear.weight"] = _cols(r * inner, inner)
            module.register_forward_hook(all_reduce_output)
        elif isinstance(module, SoftmaxMoE):  # (E, 2 * inner, hidden) and (E, hidden, inner); the router whole
            inner = module.output_linear.weight.shape[2]
            s[prefix + "input_linear.weight"] = _gate_up(r * inner, inner, self.world * inner, dim=1)
            s[prefix + "output_linear.weight"] = lambda t: t[:, :, r * inner : (r + 1) * inner]
            module.register_forward_hook(all_reduce_output)
        mixer = getattr(module, "mixer", None)  # a Nemotron-H block: its MLP or MoE output is a partial sum
        if isinstance(mixer, MLP | MoE):
            mixer.register_forward_hook(all_reduce_output)

    def _shard_mamba(self, prefix: str, mixer: Mamba2Mixer) -> None:
        cfg, shard, s = self.model, self.mamba, self._slicers
        p = cfg.mamba_head_dim
        # On the CPU, as checkpoint tensors are read: `build` runs under the loader's meta device.
        channels = torch.tensor(shard.conv_channels(cfg), device="cpu")
        rows = torch.tensor(shard.in_proj_rows(cfg), device="cpu")
        s[prefix + "in_proj.weight"] = s[prefix + "in_proj.bias"] = _index(rows)
        s[prefix + "conv1d.weight"] = s[prefix + "conv1d.bias"] = _index(channels)
        for name in ("dt_bias", "A_log", "D"):
            s[prefix + name] = _rows(shard.head_start, shard.num_heads)
        s[prefix + "norm.weight"] = _rows(shard.head_start * p, shard.num_heads * p)
        s[prefix + "out_proj.weight"] = _cols(shard.head_start * p, shard.num_heads * p)
        s[prefix + "out_proj.bias"] = self._first_rank_only
        group_size = cfg.mamba_intermediate_size // cfg.n_groups
        # The rank's channels cut through norm groups (Falcon-H1's gate-only "norm" has none).
        if (shard.num_heads * p) % group_size and not isinstance(mixer.norm, GateOnly):
            before = getattr(mixer.norm, "norm_before_gate", False)
            mixer.norm = ShardedGatedRMSNorm(shard.num_heads * p, shard.head_start * p, group_size, cfg.n_groups,
                                             cfg.layer_norm_epsilon, norm_before_gate=before)

    def _shard_gated_delta(self, prefix: str, mixer: GatedDeltaNet) -> None:
        """The rank's key heads and the value heads that read them (value head j reads key head
        j // (Hv / Hk), so both runs are contiguous): their q, k, v, z, b and a rows, conv channels,
        A_log and dt_bias entries and out_proj columns. The gated norm's (V,) weight, shared by the
        heads, stays whole: it normalizes each head on its own."""
        cfg, s = self.model, self._slicers
        hk, hv, kd, vd = mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim
        k0, v0 = self.rank * hk, self.rank * hv  # the rank's first key and value head
        qk_dim = cfg.linear_num_key_heads * kd
        # The conv's channels are [q | k | v] over all heads in both layouts, and so is in_proj_qkv's output.
        # On the CPU, as checkpoint tensors are read: `build` runs under the loader's meta device.
        starts_counts = ((k0 * kd, hk * kd), (qk_dim + k0 * kd, hk * kd), (2 * qk_dim + v0 * vd, hv * vd))
        qkv = torch.cat([torch.arange(start, start + n, device="cpu") for start, n in starts_counts])
        s[prefix + "conv1d.weight"] = _index(qkv)
        if mixer.fused_projections:  # Qwen3-Next's rows run key head by key head: whole groups, contiguous
            qkvz_rows, ba_rows = mixer.in_proj_qkvz.out_features // hk, mixer.in_proj_ba.out_features // hk
            s[prefix + "in_proj_qkvz.weight"] = _rows(k0 * qkvz_rows, hk * qkvz_rows)
            s[prefix + "in_proj_ba.weight"] = _rows(k0 * ba_rows, hk * ba_rows)
        else:
            s[prefix + "in_proj_qkv.weight"] = _index(qkv)
            s[prefix + "in_proj_z.weight"] = _rows(v0 * vd, hv * vd)
            s[prefix + "in_proj_b.weight"] = s[prefix + "in_proj_a.weight"] = _rows(v0, hv)
        s[prefix + "A_log"] = s[prefix + "dt_bias"] = _rows(v0, hv)
        s[prefix + "out_proj.weight"] = _cols(v0 * vd, hv * vd)

    def _first_rank_only(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self.rank == 0 else torch.zeros_like(tensor)


def _rows(start: int, count: int) -> Slicer:
    """Rows start .. start + count - 1, zero-padded past the tensor's end (the vocab's last shard)."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        part = t[start : start + count]
        if part.shape[0] < count:
            part = torch.cat([part, part.new_zeros(count - part.shape[0], *part.shape[1:])])
        return part
    return cut


def _gate_up(start: int, count: int, half: int, dim: int) -> Slicer:
    """Of a tensor whose `dim` stacks gate (the first `half`) and up: rows start .. start + count - 1
    of each half, gate's first."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t.narrow(dim, start, count), t.narrow(dim, half + start, count)], dim=dim)
    return cut


def _cols(start: int, count: int) -> Slicer:
    return lambda t: t[:, start : start + count]


def _index(rows: torch.Tensor) -> Slicer:
    return lambda t: t.index_select(0, rows.to(t.device))
