"""Falcon-H1's Mamba2 mixer: Nemotron-H's, with muP multipliers on its input (`ssm_in_multiplier`)
and on each section of in_proj's output (`ssm_multipliers`: z, x, B, C, dt), and its own gated
norm: none (y * silu(z)) or a grouped RMS norm before or after the gate (`mamba_rms_norm`,
`mamba_norm_before_gate`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.mamba2 import Mamba2Mixer
from replayserve.ops.dtypes import compute_dtype


class GateOnly(nn.Module):
    """y * silu(z) (`mamba_rms_norm: false`): no weight."""

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return x * F.silu(z)


class FalconGatedRMSNorm(nn.Module):
    """RMS norm per group of channels, times the weight, with the silu(z) gate before the norm or
    after it; computed in the compute dtype and cast back once, as transformers does."""

    def __init__(self, hidden_size: int, n_groups: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.n_groups = n_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z (T, D) -> (T, D) in x.dtype."""
        cdt = compute_dtype(x.dtype)
        h = x.to(cdt)
        gate = F.silu(z.to(cdt))
        if not self.norm_before_gate:
            h = h * gate
        groups = h.view(h.shape[0], self.n_groups, -1)
        groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight.view(self.n_groups, -1) * groups
        h = h.view(x.shape)
        if self.norm_before_gate:
            h = h * gate
        return h.to(x.dtype)


class FalconMamba2Mixer(Mamba2Mixer):
    fused_in_proj = False  # the multipliers sit between in_proj and the conv

    def __init__(self, cfg: ModelConfig, mamba_index: int) -> None:
        super().__init__(cfg, mamba_index)
        inner = cfg.mamba_intermediate_size
        self.norm = (FalconGatedRMSNorm(inner, cfg.n_groups, cfg.layer_norm_epsilon, cfg.mamba_norm_before_gate)
                     if cfg.mamba_rms_norm else GateOnly())
        self.in_multiplier = cfg.ssm_in_multiplier
        groups_state = cfg.n_groups * cfg.ssm_state_size
        self.section_sizes = (inner, inner, groups_state, groups_state, cfg.mamba_num_heads)
        self.section_multipliers = cfg.ssm_multipliers or (1.0,) * 5
        self._scale_on: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def _scale(self, like: torch.Tensor) -> torch.Tensor:
        """(inner + conv_dim + heads,) in like's dtype, made on its device by kernels there and kept:
        not a buffer, which the loader's meta-device build would leave uninitialised. Not kept when
        first made inside a CUDA-graph capture (its memory would belong to the graph's pool)."""
        key = (like.device, like.dtype)
        scale = self._scale_on.get(key)
        if scale is None:
            sections = zip(self.section_sizes, self.section_multipliers, strict=True)
            scale = torch.cat([torch.full((n,), m, dtype=torch.float32, device=like.device)
                               for n, m in sections]).to(like.dtype)
            if not (like.is_cuda and torch.cuda.is_current_stream_capturing()):
                self._scale_on[key] = scale
        return scale

    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        proj = self.in_proj(hidden * self.in_multiplier)
        return proj * self._scale(proj)
