"""The Mamba2 decode step (selective state update) of the baseline SSM backend: the entry point
runs the kernel of ``ssu_triton`` on CUDA (whatever the dtypes; ``dispatch.use_triton``) and the
reference elsewhere."""

from __future__ import annotations

import math

from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.ssd import selective_state_update_ref


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
