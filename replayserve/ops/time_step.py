"""The processed time step of every Mamba2 op that takes a raw dt (the SSD scan, the decode step,
ReplaySSM's ring): the reference; ``time_step_triton.process_dt`` is the kernels' twin."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def process_dt(
    dt: Tensor,
    dt_bias: Tensor | None,
    dt_softplus: bool,
    dt_limit: tuple[float, float],
) -> Tensor:
    """Processed time step: clamp(softplus(dt + dt_bias), *dt_limit), elementwise, in dt's dtype.

    dt_bias broadcasts against dt's last (head) axis; shared by every op that takes a raw dt.
    """
    delta = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:
        delta = F.softplus(delta)
    return delta.clamp(min=dt_limit[0], max=dt_limit[1])
