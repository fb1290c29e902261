"""The Nemotron-H Mamba2 mixer: projections and gated norm here, state handling in `ssm/`."""

from __future__ import annotations

import math

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.engine.context import StepContext
from replayserve.layers.norm import GatedRMSNorm
from replayserve.ops.dtypes import compute_dtype
from replayserve.ssm.backend import MambaParams, SSMBackend


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, mamba_index: int) -> None:
        super().__init__()
        self.mamba_index = mamba_index  # position among the model's Mamba layers
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.chunk_size = cfg.chunk_size
        self.dt_limit = (cfg.time_step_min, math.inf)
        inner, conv_dim = cfg.mamba_intermediate_size, cfg.conv_dim
        self.split_sizes = [inner, conv_dim, self.num_heads]
        self.in_proj = nn.Linear(cfg.hidden_size, sum(self.split_sizes), bias=cfg.use_bias)
        # nn.Conv1d only holds the (conv_dim, 1, K) weight under its Hugging Face name.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(inner, inner // cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = nn.Linear(inner, cfg.hidden_size, bias=cfg.use_bias)

    def params(self) -> MambaParams:
        cdt = compute_dtype(self.in_proj.weight.dtype)
        return MambaParams(
            conv_weight=self.conv1d.weight.squeeze(1),
            conv_bias=self.conv1d.bias,
            A=-torch.exp(self.A_log.to(cdt)),
            D=self.D.to(cdt),
            dt_bias=self.dt_bias.to(cdt),
            dt_limit=self.dt_limit,
            chunk_size=self.chunk_size,
        )

    def forward(self, hidden: torch.Tensor, ctx: StepContext, backend: SSMBackend) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size)."""
        z, xbc, dt = self.in_proj(hidden).split(self.split_sizes, dim=-1)
        params = self.params()
        y = hidden.new_empty(hidden.shape[0], self.num_heads, self.head_dim)
        nd = ctx.num_decodes
        if nd:
            y[:nd] = backend.decode(self.mamba_index, ctx.state_slots[:nd], xbc[:nd], dt[:nd], params)
        for start, end, slot, captures in ctx.prefill_segments():
            y[start:end] = backend.prefill(self.mamba_index, slot, xbc[start:end], dt[start:end], params, captures)
        y = self.norm(y.reshape(hidden.shape[0], -1), z)
        return self.out_proj(y)
