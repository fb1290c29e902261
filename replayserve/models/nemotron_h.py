"""Nemotron-H for causal LM, with Hugging Face's checkpoint parameter names (`backbone.*`)."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ATTENTION, MAMBA, ModelConfig
from replayserve.config import MLP as MLP_TYPE
from replayserve.layers.attention import Attention
from replayserve.layers.linear import Linear
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.mlp import MLP, MoE
from replayserve.layers.norm import RMSNorm
from replayserve.layers.step_context import StepContext
from replayserve.models.nemotron_h_mtp import NemotronHMTP
from replayserve.ops.dtypes import compute_dtype
from replayserve.ssm.backend import SSMBackend


class NemotronHBlock(nn.Module):
    """Pre-norm residual block around one mixer; `index` counts layers of the same kind."""

    def __init__(self, cfg: ModelConfig, block_type: str, index: int) -> None:
        super().__init__()
        self.block_type = block_type
        self.index = index
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer: nn.Module
        if block_type == MAMBA:
            self.mixer = Mamba2Mixer(cfg, index)
        elif block_type == ATTENTION:
            self.mixer = Attention(cfg)
        elif block_type == MLP_TYPE:
            self.mixer = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        else:
            self.mixer = MoE(cfg)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        counts: dict[str, int] = {}
        blocks = []
        for block_type in cfg.layer_types:
            blocks.append(NemotronHBlock(cfg, block_type, counts.get(block_type, 0)))
            counts[block_type] = counts.get(block_type, 0) + 1
        self.layers = nn.ModuleList(blocks)
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class NemotronHForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.backbone = Backbone(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.num_nextn_predict_layers:
            self.mtp = NemotronHMTP(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.backbone.embeddings.weight

    def cast_(self, dtype: torch.dtype) -> NemotronHForCausalLM:
        """Casts to `dtype`, keeping MoE routers in the compute dtype (float32 for half models);
        each MoE layer's expert weights become views of its two stacks (`MoE.stacked_experts`)."""
        self.to(dtype)
        for module in self.modules():
            if isinstance(module, MoE):
                module.gate.to(compute_dtype(dtype))
                module.stacked_experts()
        return self

    def allocate_(self, device: torch.device | str, dtype: torch.dtype) -> NemotronHForCausalLM:
        """Gives a model built on the meta device uninitialised weights on `device`, allocated in
        `dtype` directly (float32 first would take 126 GB for a 30B model), then `cast_`."""
        self.cast_(dtype)  # on the meta device: allocates nothing
        self.to_empty(device=device)
        return self.cast_(dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        ctx: StepContext,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        ssm: SSMBackend | None,
    ) -> torch.Tensor:
        """input_ids (T,) -> final hidden states (T, hidden_size).

        kv_caches holds one (K, V) pair per attention layer; `ssm` owns every Mamba layer's state.
        """
        residual = self.backbone.embeddings(input_ids)
        out = None
        for block in self.backbone.layers:
            # The previous block's residual add is fused with this block's pre-norm.
            if out is None:
                normed = block.norm(residual)
            else:
                normed, residual = block.norm.add_forward(out, residual)
            if block.block_type == MAMBA:
                out = block.mixer(normed, ctx, ssm)
            elif block.block_type == ATTENTION:
                out = block.mixer(normed, ctx, kv_caches[block.index])
            else:
                out = block.mixer(normed)
        if out is None:
            return self.backbone.norm_f(residual)
        return self.backbone.norm_f.add_forward(out, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """(S, hidden_size) -> (S, vocab) in the compute dtype."""
        return self.lm_head(hidden).to(compute_dtype(hidden.dtype))


__all__ = ["NemotronHForCausalLM"]
