"""The one place that derives every recurrent state tensor's shape and dtype (Mamba2, Gated DeltaNet)
from the configs."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from replayserve.config import ModelConfig
from replayserve.ops.dtypes import compute_dtype


@dataclass(frozen=True)
class MambaLayout:
    """Per-slot Mamba2 state geometry for all Mamba layers of a model (one tensor-parallel rank)."""

    num_layers: int
    num_slots: int
    num_heads: int  # H
    head_dim: int  # P
    state_size: int  # N
    n_groups: int  # G
    conv_kernel: int  # K
    act_dtype: torch.dtype
    state_dtype: torch.dtype
    window: int = 0  # ReplaySSM logical window W; 0 for the baseline backend (no rings)
    tokens_per_step: int = 1  # T: 1 for plain decode, 1 + k with k draft tokens

    @classmethod
    def from_config(
        cls, model: ModelConfig, num_slots: int, dtype: torch.dtype, window: int = 0, tokens_per_step: int = 1
    ) -> MambaLayout:
        # The SSM state accumulates over the whole sequence, so half-precision models keep it in
        # float32 (Hugging Face's `mamba_ssm_cache_dtype` default); wider dtypes keep their own.
        return cls(
            num_layers=model.num_mamba_layers,
            num_slots=num_slots,
            num_heads=model.mamba_num_heads,
            head_dim=model.mamba_head_dim,
            state_size=model.ssm_state_size,
            n_groups=model.n_groups,
            conv_kernel=model.conv_kernel,
            act_dtype=dtype,
            state_dtype=compute_dtype(dtype),
            window=window,
            tokens_per_step=tokens_per_step,
        )

    @property
    def x_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def bc_dim(self) -> int:
        return self.n_groups * self.state_size

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: x, B and C concatenated."""
        return self.x_dim + 2 * self.bc_dim

    @property
    def conv_state_shape(self) -> tuple[int, int, int]:
        """(slots, conv_dim, K - 1): the last K - 1 pre-conv inputs, oldest first."""
        return (self.num_slots, self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int, int]:
        """(slots, H, P, N)."""
        return (self.num_slots, self.num_heads, self.head_dim, self.state_size)

    def split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(T, conv_dim) -> x (T, H, P), B (T, G, N), C (T, G, N)."""
        x, b, c = xbc.split([self.x_dim, self.bc_dim, self.bc_dim], dim=-1)
        t = xbc.shape[0]
        return (
            x.reshape(t, self.num_heads, self.head_dim),
            b.reshape(t, self.n_groups, self.state_size),
            c.reshape(t, self.n_groups, self.state_size),
        )

    @property
    def ring_len(self) -> int:
        """R = W + T exactly: never rounded up, since kernels infer the window as R - T."""
        return self.window + self.tokens_per_step if self.window else 0

    @property
    def x_ring_shape(self) -> tuple[int, int, int, int]:
        """(slots, H, R, P), activation dtype."""
        return (self.num_slots, self.num_heads, self.ring_len, self.head_dim)

    @property
    def dt_ring_shape(self) -> tuple[int, int, int]:
        """(slots, H, R), state dtype: processed time steps, so replay needs no bias or softplus."""
        return (self.num_slots, self.num_heads, self.ring_len)

    @property
    def b_ring_shape(self) -> tuple[int, int, int, int]:
        """(slots, G, R, N), activation dtype: shared by the group's heads."""
        return (self.num_slots, self.n_groups, self.ring_len, self.state_size)

    @property
    def cursor_shape(self) -> tuple[int]:
        """(slots,): ring_start and history int32, is_flush bool; shared by all Mamba layers."""
        return (self.num_slots,)


@dataclass(frozen=True)
class MambaShard:
    """The Mamba2 heads and B/C groups one tensor-parallel rank holds; a rank's `MambaLayout` is
    that of its shard (`num_heads`, `num_groups`).

    Heads split evenly. A rank keeps the groups its heads read: n_groups / world whole groups when
    the ranks divide n_groups; otherwise its heads straddle group boundaries and it keeps one copy
    of a group per run of `heads_per_group` local heads that read it (the extra groups vLLM adds),
    so that every local group serves the same number of heads, as the SSM kernels assume."""

    head_start: int  # the rank's first head, in the model's numbering
    num_heads: int
    groups: tuple[int, ...]  # the model's group of each local group, in local order

    @classmethod
    def of(cls, model: ModelConfig, rank: int, world: int) -> MambaShard:
        heads = model.mamba_num_heads // world
        per_group = model.mamba_num_heads // model.n_groups
        local_per_group = math.gcd(per_group, heads)  # divides heads and every rank's head_start
        start = rank * heads
        return cls(start, heads, tuple((start + j * local_per_group) // per_group
                                       for j in range(heads // local_per_group)))

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def conv_channels(self, model: ModelConfig) -> list[int]:
        """The model's conv (x, B, C) channels this rank holds, in its local order."""
        p, n, inner = model.mamba_head_dim, model.ssm_state_size, model.mamba_intermediate_size
        x = list(range(self.head_start * p, (self.head_start + self.num_heads) * p))
        b = [inner + g * n + i for g in self.groups for i in range(n)]
        c = [inner + model.n_groups * n + g * n + i for g in self.groups for i in range(n)]
        return x + b + c

    def in_proj_rows(self, model: ModelConfig) -> list[int]:
        """The model's in_proj output rows (z, x B C, dt) this rank holds, in its local order."""
        p, inner = model.mamba_head_dim, model.mamba_intermediate_size
        z = list(range(self.head_start * p, (self.head_start + self.num_heads) * p))
        dt = list(range(inner + model.conv_dim + self.head_start, inner + model.conv_dim + self.head_start
                        + self.num_heads))
        return z + [inner + c for c in self.conv_channels(model)] + dt


@dataclass(frozen=True)
class GatedDeltaLayout:
    """Per-slot Gated DeltaNet state geometry for all GDN layers of a model: per layer a conv
    state over q, k and v (activation dtype) and a (Hv, K, V) recurrent state per slot."""

    num_layers: int
    num_slots: int
    num_key_heads: int  # Hk: query and key heads
    num_value_heads: int  # Hv: value heads, a multiple of Hk
    key_dim: int  # K
    value_dim: int  # V
    conv_kernel: int
    act_dtype: torch.dtype
    state_dtype: torch.dtype
    tokens_per_step: int = 1  # T: 1 for plain decode, 1 + k with k draft tokens
    window: int = 0  # ReplaySSM logical window W; 0 for the baseline backend (no rings)
    max_rows: int = 0  # decode rows a step runs at most (max_num_seqs); 0: num_slots

    @classmethod
    def from_config(cls, model: ModelConfig, num_slots: int, dtype: torch.dtype,
                    tokens_per_step: int = 1, window: int = 0, max_rows: int = 0) -> GatedDeltaLayout:
        # As for Mamba2: the state accumulates over the whole sequence, so half-precision models keep
        # it in float32 (the published checkpoints' `mamba_ssm_dtype`); wider dtypes keep their own.
        return cls(
            num_layers=model.num_gated_delta_layers,
            num_slots=num_slots,
            num_key_heads=model.linear_num_key_heads,
            num_value_heads=model.linear_num_value_heads,
            key_dim=model.linear_key_head_dim,
            value_dim=model.linear_value_head_dim,
            conv_kernel=model.linear_conv_kernel_dim,
            act_dtype=dtype,
            state_dtype=compute_dtype(dtype),
            tokens_per_step=tokens_per_step,
            window=window,
            max_rows=max_rows,
        )

    @property
    def qk_dim(self) -> int:
        return self.num_key_heads * self.key_dim

    @property
    def v_dim(self) -> int:
        return self.num_value_heads * self.value_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the depthwise conv: q, k and v concatenated."""
        return 2 * self.qk_dim + self.v_dim

    @property
    def conv_state_shape(self) -> tuple[int, int, int]:
        """(slots, conv_dim, K_conv - 1): the last K_conv - 1 pre-conv inputs, oldest first."""
        return (self.num_slots, self.conv_dim, self.conv_kernel - 1)

    @property
    def ssm_state_shape(self) -> tuple[int, int, int, int]:
        """(slots, Hv, K, V): each value head's key-by-value memory."""
        return (self.num_slots, self.num_value_heads, self.key_dim, self.value_dim)

    @property
    def spec_states_shape(self) -> tuple[int, int, int, int, int]:
        """(rows, T, Hv, K, V): the baseline's state after each verified token, per row of a step."""
        return (self.max_rows or self.num_slots, self.tokens_per_step, *self.ssm_state_shape[1:])

    def split_qkv(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(..., conv_dim) -> q (..., Hk, K), k (..., Hk, K), v (..., Hv, V)."""
        q, k, v = qkv.split([self.qk_dim, self.qk_dim, self.v_dim], dim=-1)
        lead = qkv.shape[:-1]
        return (q.reshape(*lead, self.num_key_heads, self.key_dim), k.reshape(*lead, self.num_key_heads, self.key_dim),
                v.reshape(*lead, self.num_value_heads, self.value_dim))

    @property
    def ring_len(self) -> int:
        """R = W + T exactly: never rounded up, since the kernels infer the window as R - T."""
        return self.window + self.tokens_per_step if self.window else 0

    @property
    def k_ring_shape(self) -> tuple[int, int, int, int]:
        """(slots, Hk, R, K), activation dtype: raw keys (before the L2 norm), shared by a key head's value heads."""
        return (self.num_slots, self.num_key_heads, self.ring_len, self.key_dim)

    @property
    def delta_ring_shape(self) -> tuple[int, int, int, int]:
        """(slots, Hv, R, V), state dtype: each token's correction delta (ops/replay_gdn.py)."""
        return (self.num_slots, self.num_value_heads, self.ring_len, self.value_dim)

    @property
    def gate_ring_shape(self) -> tuple[int, int, int]:
        """(slots, Hv, R), state dtype: the g ring (log decays)."""
        return (self.num_slots, self.num_value_heads, self.ring_len)

    @property
    def cursor_shape(self) -> tuple[int]:
        """(slots,): ring_start and history int32, is_flush bool; shared by all GDN layers."""
        return (self.num_slots,)
