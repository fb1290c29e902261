"""The Mamba2 decode step (selective state update) of the baseline SSM backend: the reference,
and the entry point that runs the kernel of ``ssu_triton`` on CUDA (whatever the dtypes;
``dispatch.use_triton``) and the reference elsewhere."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.ssd import heads_per_group
from replayserve.ops.time_step import process_dt


def selective_state_update_ref(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    state_indices: Tensor | None = None,
) -> Tensor:
    """One Mamba2 decode step for a batch of sequences (same recurrence as ssd_chunk_scan_ref).

    Arguments:
        state: (S, H, P, N) pool of SSM states; rows ``state_indices`` are
            updated IN PLACE (written back in state.dtype), other rows untouched.
        x: (B, H, P) one token per sequence.
        dt: (B, H) raw time step.
        A: (H,) negative decay rates.
        B, C: (B, G, N), H % G == 0.
        D: (H,) or None.
        dt_bias: (H,) or None.
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (min, max) clamp applied to the processed dt.
        state_indices: (B,) int64 distinct slots, or None for arange(B) with S == B.

    Returns:
        y: (B, H, P) in x.dtype. Computed in the wider of state.dtype and
        compute_dtype(x.dtype).
    """
    batch, nheads, _ = x.shape
    rep = heads_per_group(nheads, B.shape[1])
    if state_indices is None:
        if state.shape[0] != batch:
            raise ValueError(f"state_indices=None needs S == B, got S={state.shape[0]}, B={batch}")
        idx = torch.arange(batch, device=state.device)
    else:
        if state_indices.shape != (batch,):
            raise ValueError(f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
        idx = state_indices.long()
    cdt = torch.promote_types(state.dtype, compute_dtype(x.dtype))

    delta = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    xc = x.to(cdt)
    Bh = B.to(cdt).repeat_interleave(rep, dim=1)  # (B, H, N)
    Ch = C.to(cdt).repeat_interleave(rep, dim=1)
    decay = torch.exp(delta * A.to(cdt))  # (B, H)

    s = state[idx].to(cdt)
    s = decay[:, :, None, None] * s + (delta[:, :, None] * xc)[..., None] * Bh[:, :, None, :]
    y = torch.einsum("bhpn,bhn->bhp", s, Ch)
    if D is not None:
        y = y + D.to(cdt)[:, None] * xc
    state[idx] = s.to(state.dtype)
    return y.to(x.dtype)


def selective_state_update(state: Tensor, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
                           D: Tensor | None = None, dt_bias: Tensor | None = None,
                           dt_limit: tuple[float, float] = (0.0, math.inf),
                           state_indices: Tensor | None = None) -> Tensor:
    """``selective_state_update_ref`` with softplus, by its kernel where it serves the pool `state`."""
    if use_triton(state, None):
        from replayserve.ops.ssu_triton import selective_state_update_triton

        return selective_state_update_triton(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                                             state_indices=state_indices)
    return selective_state_update_ref(state, x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_limit=dt_limit,
                                      state_indices=state_indices)
