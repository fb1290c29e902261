"""TII Falcon-H1 (`falcon_h1`) for causal LM: every layer runs a Mamba2 and an attention mixer side
by side on the same normed input, sums them (each scaled by its muP multiplier), then a SwiGLU MLP.

`layer_types` lists each layer's pair (Mamba2, attention), so the engine sizes one Mamba state and
one KV cache per layer. The attention's input multiplier and `key_multiplier` are folded into its
scale (q, k and v are linear in the input: the scores scale by in^2 * key, the output by in); every
other multiplier into the weights once they are loaded (`layers/fold.py`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.attention import Attention
from replayserve.layers.falcon_mamba import FalconMamba2Mixer
from replayserve.layers.fold import scale_rows_
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.norm import RMSNorm
from replayserve.layers.step_context import StepContext
from replayserve.models.granite_hybrid import GraniteMoeHybridForCausalLM, HybridModel
from replayserve.ssm.backend import SSMBackend


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mamba = FalconMamba2Mixer(cfg, index)
        scale = cfg.head_dim**-0.5 * cfg.key_multiplier * cfg.attention_in_multiplier**2
        self.self_attn = Attention(dataclasses.replace(cfg, attention_multiplier=scale))
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.feed_forward = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    def mix(self, normed: torch.Tensor, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            ssm: SSMBackend | None) -> torch.Tensor:
        return self.mamba(normed, ctx, ssm) + self.self_attn(normed, ctx, kv_caches[self.index])

    @property
    def ffn_norm(self) -> RMSNorm:
        return self.pre_ff_layernorm

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(normed)

    def stack_projections_(self) -> None:
        """Attention's q, k and v and the MLP's gate and up as one projection each (`layers/stacked.py`)."""
        self.self_attn.stack_projections_()
        self.feed_forward.stack_projections_()

    def fold_multipliers_(self, cfg: ModelConfig) -> None:
        """The mixers' output multipliers into their output projections, the MLP's into gate_proj
        and down_proj, the SSM's input ones into in_proj (`FalconMamba2Mixer.fold_multipliers_`)."""
        self.mamba.fold_multipliers_()
        scale_rows_(self.mamba.out_proj, cfg.ssm_out_multiplier)
        scale_rows_(self.self_attn.o_proj, cfg.attention_in_multiplier * cfg.attention_out_multiplier)
        gate, down = cfg.mlp_multipliers or (1.0, 1.0)
        scale_rows_(self.feed_forward.gate_proj, float(gate))
        scale_rows_(self.feed_forward.down_proj, float(down))


class FalconH1Model(HybridModel):
    @staticmethod
    def build_layers(cfg: ModelConfig, layer_class: type) -> list[nn.Module]:
        """One layer per (Mamba2, attention) pair of layer_types."""
        return [layer_class(cfg, i) for i in range(len(cfg.layer_types) // 2)]


class FalconH1ForCausalLM(GraniteMoeHybridForCausalLM):
    """Granite's forward and folds (embedding_multiplier; residual_multiplier 1; logits_scaling is
    1 / lm_head_multiplier) over Falcon-H1's layers."""

    layer_class = FalconH1DecoderLayer
    backbone_class = FalconH1Model
    final_norm_name = "final_layernorm"


__all__ = ["FalconH1ForCausalLM"]
