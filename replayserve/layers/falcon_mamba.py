"""Falcon-H1's Mamba2 mixer: Nemotron-H's, with muP multipliers on its input (`ssm_in_multiplier`)
and on each section of in_proj's output (`ssm_multipliers`: z, x, B, C, dt), folded into in_proj
once the weights are loaded (`fold_multipliers_`), and its own gated norm: none (y * silu(z)) or a
grouped RMS norm before or after the gate (`mamba_rms_norm`, `mamba_norm_before_gate`; after the
gate it is Nemotron-H's; both orders are the project's fused op)."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.fold import scale_rows_
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.layers.norm import GatedRMSNorm
from replayserve.ops.activation import silu_mul


class GateOnly(nn.Module):
    """y * silu(z) (`mamba_rms_norm: false`): no weight."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return silu_mul(z, x)


class FalconMamba2Mixer(Mamba2Mixer):
    def __init__(self, cfg: ModelConfig, mamba_index: int) -> None:
        super().__init__(cfg, mamba_index)
        inner = cfg.mamba_intermediate_size
        self.norm: nn.Module = GateOnly()
        if cfg.mamba_rms_norm:
            self.norm = GatedRMSNorm(inner, inner // cfg.n_groups, cfg.layer_norm_epsilon, cfg.mamba_norm_before_gate)
        self.in_multiplier = cfg.ssm_in_multiplier
        groups_state = cfg.n_groups * cfg.ssm_state_size
        self.section_sizes = (inner, inner, groups_state, groups_state, cfg.mamba_num_heads)
        self.section_multipliers = cfg.ssm_multipliers or (1.0,) * 5

    def fold_multipliers_(self) -> None:
        """in_proj(x * in) * s per section = (in * s) W x + s b: scales in_proj's rows (and its bias's,
        by s alone) in place. The sections are this mixer's (a tensor-parallel rank's own)."""
        weight = self.in_proj.weight
        wide = torch.promote_types(weight.dtype, torch.float32)
        rows = torch.cat([torch.full((n,), m, dtype=wide, device=weight.device)
                          for n, m in zip(self.section_sizes, self.section_multipliers, strict=True)])
        scale_rows_(self.in_proj, rows * self.in_multiplier, bias_factor=rows)
