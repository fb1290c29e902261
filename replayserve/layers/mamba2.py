"""The Nemotron-H Mamba2 mixer: projections and gated norm here, state handling in `ssm/`."""

from __future__ import annotations

import math

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.norm import GatedRMSNorm
from replayserve.layers.step_context import StepContext
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.gemv import gemv_serves
from replayserve.ssm.backend import SSMBackend
from replayserve.ssm.params import MambaParams

# A batch-1 decode step runs the conv update inside the in_proj GEMV (`ops/gemv_triton.gemv_conv_triton`):
# one launch fewer per Mamba layer. A switch so that tests can compare it with the conv kernel.
FUSED_CONV_AT_ONE_ROW = True


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, mamba_index: int) -> None:
        super().__init__()
        self.mamba_index = mamba_index  # position among the model's Mamba layers
        self.num_heads = cfg.mamba_num_heads
        self.head_dim = cfg.mamba_head_dim
        self.chunk_size = cfg.chunk_size
        self.dt_limit = tuple(cfg.dt_limit) if cfg.dt_limit else (cfg.time_step_min, math.inf)
        inner, conv_dim = cfg.mamba_intermediate_size, cfg.conv_dim
        self.split_sizes = [inner, conv_dim, self.num_heads]
        self.in_proj = Linear(cfg.hidden_size, sum(self.split_sizes), bias=cfg.use_bias)
        # nn.Conv1d only holds the (conv_dim, 1, K) weight under its Hugging Face name.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.conv_kernel, groups=conv_dim, bias=cfg.use_conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = GatedRMSNorm(inner, inner // cfg.n_groups, cfg.layer_norm_epsilon)
        self.out_proj = Linear(inner, cfg.hidden_size, bias=cfg.use_bias)

    def params(self) -> MambaParams:
        """The state update's view of the weights. A = -exp(A_log) and the casts are computed once
        and kept until a weight changes (a new tensor or an in-place write bumps its version): per
        step they would be a few kernels in every Mamba layer."""
        # conv1d, not in_proj (float8 in an FP8 checkpoint) or the norm (Falcon-H1 may have none): it is
        # never quantized and every family has it.
        cdt = compute_dtype(self.conv1d.weight.dtype)
        key = (cdt,) + tuple((id(t), t._version, t.data_ptr()) for t in (self.A_log, self.D, self.dt_bias))
        if getattr(self, "_derived_key", None) != key:
            with torch.no_grad():
                self._derived = (-torch.exp(self.A_log.to(cdt)), self.D.to(cdt), self.dt_bias.to(cdt))
            self._derived_key = key
        a, d, dt_bias = self._derived
        return MambaParams(
            conv_weight=self.conv1d.weight.squeeze(1),
            conv_bias=self.conv1d.bias,
            A=a,
            D=d,
            dt_bias=dt_bias,
            dt_limit=self.dt_limit,
            chunk_size=self.chunk_size,
        )

    def forward(self, hidden: torch.Tensor, ctx: StepContext, backend: SSMBackend) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size)."""
        params = self.params()
        nd, nt, width = ctx.num_decodes, ctx.num_decode_tokens, ctx.uniform_decode
        one_row = nd == nt == hidden.shape[0] == 1 and width <= 1
        if FUSED_CONV_AT_ONE_ROW and one_row and gemv_serves(hidden, self.in_proj.weight):
            # Batch-1 decode: the conv update runs in the in_proj GEMV's epilogue (one launch fewer).
            from replayserve.ops.gemv_triton import gemv_conv_triton

            proj = gemv_conv_triton(hidden, self.in_proj.weight, self.in_proj.bias, self.split_sizes[0],
                                    backend.conv_state[self.mamba_index], params.conv_weight, params.conv_bias,
                                    ctx.state_slots[:1])
            z, xbc, dt = proj.split(self.split_sizes, dim=-1)
            y = backend.decode(self.mamba_index, ctx.state_slots[:1], xbc, dt, params, conv_done=True)
            return self.out_proj(self.norm(y.reshape(1, -1), z))
        z, xbc, dt = self.in_proj(hidden).split(self.split_sizes, dim=-1)  # z, then x B C, then dt
        y = hidden.new_empty(hidden.shape[0], self.num_heads, self.head_dim)
        if width > 1:  # a verify of rows padded to `width` tokens, fixed shapes (CUDA graphs)
            assert ctx.decode_num_tokens is not None
            y_rows = backend.verify(self.mamba_index, ctx.state_slots, xbc.view(nd, width, -1), dt.view(nd, width, -1),
                                    ctx.decode_num_tokens, params)
            y = y_rows.reshape(nt, self.num_heads, self.head_dim)
        elif nt == nd and nd:  # plain decode: one token per row
            y_dec = backend.decode(self.mamba_index, ctx.state_slots[:nd], xbc[:nd], dt[:nd], params)
            if nd == hidden.shape[0]:  # a decode-only step: no copy into y
                y = y_dec
            else:
                y[:nd] = y_dec
        elif nd:  # speculative verify: rows of 1 + drafts tokens, padded to the longest
            index, lens = padded_index(ctx.decode_lens, hidden.device)
            y_rows = backend.verify(self.mamba_index, ctx.state_slots[:nd], xbc[index], dt[index], lens, params)
            y[:nt] = y_rows.flatten(0, 1)[valid_positions(ctx.decode_lens, index.shape[1], hidden.device)]
        segments = ctx.prefill_segments()
        if segments:
            y[segments[0][0] : segments[-1][1]] = backend.prefill_batch(self.mamba_index, segments, xbc, dt, params,
                                                                         plan=ctx.prefill_plan)
        y = self.norm(y.reshape(hidden.shape[0], -1), z)
        return self.out_proj(y)


def padded_index(lens: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T) token indices of rows of `lens` tokens laid end to end, padded by repeating each
    row's last token (finite inputs; their outputs are dropped), and the lengths as int32."""
    width = max(lens)
    starts = torch.tensor([0, *lens[:-1]], device=device).cumsum(0)
    lens_t = torch.tensor(lens, device=device)
    offsets = torch.minimum(torch.arange(width, device=device)[None, :], lens_t[:, None] - 1)
    return starts[:, None] + offsets, lens_t.to(torch.int32)


def valid_positions(lens: tuple[int, ...], width: int, device: torch.device) -> torch.Tensor:
    """Flat indices into (rows * T) of each row's real tokens, in order."""
    return torch.cat([torch.arange(n, device=device) + i * width for i, n in enumerate(lens)])
