"""Bamba (`bamba`) for causal LM: Granite 4.0-H's decoder without its multipliers, with a dense
SwiGLU MLP (`feed_forward`) and RoPE (partial: half of each head by default) in attention."""

from __future__ import annotations

import torch

from replayserve.config import ModelConfig
from replayserve.layers.fold import scale_rows_
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.norm import RMSNorm
from replayserve.models.granite_hybrid import GraniteMoeHybridForCausalLM, MixerLayer


class BambaDecoderLayer(MixerLayer):
    def __init__(self, cfg: ModelConfig, block_type: str, index: int) -> None:
        super().__init__(cfg, block_type, index)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.feed_forward = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)

    @property
    def ffn_norm(self) -> RMSNorm:
        return self.pre_ff_layernorm

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(normed)

    def fold_ffn_(self, factor: float) -> None:
        scale_rows_(self.feed_forward.down_proj, factor)


class BambaForCausalLM(GraniteMoeHybridForCausalLM):
    """The multipliers stay 1 (config/hf_families.py sets none for Bamba): the forward is Granite's."""

    layer_class = BambaDecoderLayer
    final_norm_name = "final_layernorm"


__all__ = ["BambaForCausalLM"]
