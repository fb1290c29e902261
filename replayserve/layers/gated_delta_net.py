"""The Gated DeltaNet mixer of Qwen3-Next and Qwen3.5: projections, gates and the gated norm here,
the conv and recurrent state in a `ssm/gated_delta_backend.py` backend.

Per token: q, k, v from the input projection go through a depthwise causal conv1d with SiLU; the
state backend L2-normalizes q and k and runs the gated delta rule with the log-space decay
g = -exp(A_log) * softplus(a + dt_bias) and the write strength beta = sigmoid(b); the rule's output
per value head is RMS-normed, scaled by the norm's weight and gated by silu(z); then out_proj.

The projections are named as the checkpoints name them. Qwen3-Next fuses them per key head:
`in_proj_qkvz` gives, for each of the Hk key heads, [q (K), k (K), v (r V), z (r V)] with
r = Hv / Hk, and `in_proj_ba` [b (r), a (r)]; Qwen3.5 has `in_proj_qkv` ([q | k | v], all heads),
`in_proj_z`, `in_proj_b` and `in_proj_a`. The conv's channels are [q | k | v] in both.
"""

from __future__ import annotations

import torch
from torch import nn

from replayserve.config import ModelConfig
from replayserve.layers.linear import Linear
from replayserve.layers.mamba2 import padded_index, valid_positions
from replayserve.layers.step_context import StepContext
from replayserve.ops.gdn_gates import gdn_gates
from replayserve.ops.norm import gated_rms_norm
from replayserve.ssm.gated_delta_backend import GatedDeltaBackend


class HeadGatedRMSNorm(nn.Module):
    """RMS norm over each head's V channels, times the (V,) weight every head shares, then times
    silu(z): the norm before the gate, in the order transformers computes it."""

    def __init__(self, head_dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z (..., H, V) -> (..., H, V) in x.dtype (``ops.norm.gated_rms_norm`` with `round_normed`:
        one kernel on the GPU)."""
        v = x.shape[-1]
        flat = gated_rms_norm(x.reshape(*x.shape[:-2], -1), z.reshape(*z.shape[:-2], -1), self.weight, self.eps,
                              group_size=v, norm_before_gate=True, round_normed=True)
        return flat.view(x.shape)


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, fused_projections: bool) -> None:
        """index: the layer's position among the model's GDN layers (its state in the backend);
        fused_projections: Qwen3-Next's in_proj_qkvz / in_proj_ba, else Qwen3.5's four."""
        super().__init__()
        self.index = index
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qk_dim, v_dim = self.num_k_heads * self.head_k_dim, self.num_v_heads * self.head_v_dim
        conv_dim = cfg.gated_delta_conv_dim
        self.fused_projections = fused_projections
        if fused_projections:
            self.in_proj_qkvz = Linear(cfg.hidden_size, 2 * qk_dim + 2 * v_dim, bias=False)
            self.in_proj_ba = Linear(cfg.hidden_size, 2 * self.num_v_heads, bias=False)
        else:
            self.in_proj_qkv = Linear(cfg.hidden_size, conv_dim, bias=False)
            self.in_proj_z = Linear(cfg.hidden_size, v_dim, bias=False)
            self.in_proj_b = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
            self.in_proj_a = Linear(cfg.hidden_size, self.num_v_heads, bias=False)
        # nn.Conv1d only holds the (conv_dim, 1, K) weight under its Hugging Face name.
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel_dim, groups=conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = HeadGatedRMSNorm(self.head_v_dim, cfg.layer_norm_epsilon)
        self.out_proj = Linear(v_dim, cfg.hidden_size, bias=False)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (T, hidden_size) -> qkv (T, conv_dim) as [q | k | v], z (T, Hv, V), b and a (T, Hv)."""
        t = hidden.shape[0]
        if not self.fused_projections:
            return (self.in_proj_qkv(hidden), self.in_proj_z(hidden).view(t, self.num_v_heads, self.head_v_dim),
                    self.in_proj_b(hidden), self.in_proj_a(hidden))
        r = self.num_v_heads // self.num_k_heads
        kd, vd = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(hidden).view(t, self.num_k_heads, 2 * kd + 2 * r * vd)
        q, k, v, z = qkvz.split([kd, kd, r * vd, r * vd], dim=-1)
        b, a = self.in_proj_ba(hidden).view(t, self.num_k_heads, 2 * r).split([r, r], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, self.num_v_heads, vd), b.reshape(t, -1), a.reshape(t, -1)

    def gates(self, b: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """b, a (T, Hv) -> g (log-space decay) and beta, (T, Hv) each in the compute dtype."""
        return gdn_gates(a, b, self.A_log, self.dt_bias)

    def forward(self, hidden: torch.Tensor, ctx: StepContext, backend: GatedDeltaBackend) -> torch.Tensor:
        """hidden (T, hidden_size) -> (T, hidden_size); decode rows first, then prefill chunks."""
        qkv, z, b, a = self.project(hidden)
        g, beta = self.gates(b, a)
        weight = self.conv1d.weight.squeeze(1)
        nd, nt, width = ctx.num_decodes, ctx.num_decode_tokens, ctx.uniform_decode
        o = hidden.new_empty(hidden.shape[0], self.num_v_heads, self.head_v_dim)
        if width > 1:  # a verify of rows padded to `width` tokens, fixed shapes (CUDA graphs)
            assert ctx.decode_num_tokens is not None
            rows = backend.verify(self.index, ctx.state_slots, qkv.view(nd, width, -1), g.view(nd, width, -1),
                                  beta.view(nd, width, -1), ctx.decode_num_tokens, weight)
            o = rows.reshape(nt, self.num_v_heads, self.head_v_dim)
        elif nt == nd and nd:  # plain decode: one token per row
            rows = backend.decode(self.index, ctx.state_slots[:nd], qkv[:nd], g[:nd], beta[:nd], weight)
            if nd == hidden.shape[0]:  # a decode-only step: no copy into `o`
                o = rows
            else:
                o[:nd] = rows
        elif nd:  # speculative verify: rows of 1 + drafts tokens, padded to the longest
            index, lens = padded_index(ctx.decode_lens, hidden.device)
            rows = backend.verify(self.index, ctx.state_slots[:nd], qkv[index], g[index], beta[index], lens, weight)
            o[:nt] = rows.flatten(0, 1)[valid_positions(ctx.decode_lens, index.shape[1], hidden.device)]
        segments = ctx.prefill_segments()
        if segments:
            o[segments[0][0] : segments[-1][1]] = backend.prefill_batch(self.index, segments, qkv, g, beta, weight)
        return self.out_proj(self.norm(o, z).reshape(hidden.shape[0], -1))
