"""``time_step.process_dt`` inline in a kernel: the ReplaySSM step, the SSD chunk cumsum and the
baseline decode step call it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def process_dt(dt, dt_bias, dt_min, dt_max, DT_SOFTPLUS: tl.constexpr):
    """Delta = clamp(softplus(dt + dt_bias), dt_min, dt_max) in fp32; softplus is the identity above 20."""
    delta = dt + dt_bias
    if DT_SOFTPLUS:
        delta = tl.where(delta <= 20.0, tl.log(tl.exp(delta) + 1.0), delta)
    return tl.minimum(tl.maximum(delta, dt_min), dt_max)
