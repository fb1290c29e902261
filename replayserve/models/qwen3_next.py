"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE for causal LM (text), with the checkpoints' parameter names.

Each decoder layer is a Gated DeltaNet (`linear_attn`) or a gated attention (`self_attn`) mixer,
then a SwiGLU MLP or the MoE with its gated shared expert (`mlp`), each half behind a
zero-centered RMS norm (`input_layernorm`, `post_attention_layernorm`) and a residual add;
`config.layer_types` lists each layer's (mixer, feed-forward) pair (config/hf_qwen.py). The
families differ only in the GDN's input projections (Qwen3-Next fuses them per key head) and in
which feed-forward layers they have. The decoder loop is Granite 4.0-H's, whose multipliers are 1 here.
With `mtp_num_hidden_layers: 1` the checkpoint's MTP layer (`mtp.*`, models/qwen3_next_mtp.py) is
built too, for the MTP proposer. A multimodal Qwen3.5 checkpoint's language model
(`model.language_model.*`) loads as the text model (models/loader.py); its vision tower is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import GATED_DELTA, MOE, ModelConfig
from replayserve.config.hf_qwen import QWEN3_NEXT
from replayserve.layers.gated_attention import GatedAttention
from replayserve.layers.gated_delta_net import GatedDeltaNet
from replayserve.layers.granite_ffn import SwiGLUMLP
from replayserve.layers.norm import ZeroCenteredRMSNorm
from replayserve.layers.qwen_moe import SparseMoeBlock
from replayserve.layers.step_context import StepContext
from replayserve.models.granite_hybrid import GraniteMoeHybridForCausalLM, HybridModel
from replayserve.models.qwen3_next_mtp import QwenMTP
from replayserve.ssm.slot_state import SlotStateBackend


class QwenDecoderLayer(nn.Module):
    """One decoder layer; `index` counts the layers of its mixer's kind (GDN state, KV cache)."""

    def __init__(self, cfg: ModelConfig, mixer: str, ffn: str, index: int) -> None:
        super().__init__()
        self.block_type = mixer
        self.index = index
        self.input_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        if mixer == GATED_DELTA:
            self.linear_attn = GatedDeltaNet(cfg, index, fused_projections=cfg.model_type == QWEN3_NEXT)
        else:
            self.self_attn = GatedAttention(cfg)
        self.mlp = SparseMoeBlock(cfg) if ffn == MOE else SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, False)

    def mix(self, normed: torch.Tensor, ctx: StepContext, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
            ssm: SlotStateBackend | None) -> torch.Tensor:
        if self.block_type == GATED_DELTA:
            return self.linear_attn(normed, ctx, ssm)
        return self.self_attn(normed, ctx, kv_caches[self.index])

    @property
    def ffn_norm(self) -> ZeroCenteredRMSNorm:
        return self.post_attention_layernorm

    def ffn(self, normed: torch.Tensor) -> torch.Tensor:
        """The feed-forward half's output (before the residual add) from its pre-norm's output."""
        return self.mlp(normed)

    def fold_multipliers_(self, cfg: ModelConfig) -> None:
        """Nothing to fold: the Qwen families have no multipliers (Granite's forward's are 1)."""

    def stack_projections_(self) -> None:
        """Stacks the feed-forward half (`SparseMoeBlock.stack_projections_`, or the MLP's gate and
        up); the gated attention's q_proj holds its gate already."""
        self.mlp.stack_projections_()


class QwenModel(HybridModel):
    """The backbone (`model.*`): embedding, one layer per (mixer, feed-forward) pair, final norm."""

    def __init__(self, cfg: ModelConfig, layer_class: type, final_norm_name: str) -> None:
        super().__init__(cfg, layer_class, final_norm_name)
        setattr(self, final_norm_name, ZeroCenteredRMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon))

    @staticmethod
    def build_layers(cfg: ModelConfig, layer_class: type) -> list[nn.Module]:
        counts: dict[str, int] = {}
        layers = []
        for mixer, ffn in zip(cfg.layer_types[::2], cfg.layer_types[1::2], strict=True):
            layers.append(layer_class(cfg, mixer, ffn, counts.get(mixer, 0)))
            counts[mixer] = counts.get(mixer, 0) + 1
        return layers


class Qwen3NextForCausalLM(GraniteMoeHybridForCausalLM):
    layer_class = QwenDecoderLayer
    backbone_class = QwenModel
    final_norm_name = "norm"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        if cfg.num_nextn_predict_layers:
            self.mtp = QwenMTP(cfg)

    def prepare_weights_(self) -> Qwen3NextForCausalLM:
        """The backbone's (`GraniteMoeHybridForCausalLM.prepare_weights_`), and the MTP layer's
        feed-forward stacked as the decoder layers' are."""
        if not self.weights_prepared and hasattr(self, "mtp"):
            for layer in self.mtp.layers:
                layer.mlp.stack_projections_()
        super().prepare_weights_()
        return self


__all__ = ["Qwen3NextForCausalLM"]
