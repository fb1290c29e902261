"""The kernels' ``process_dt`` (``time_step_triton``) against the reference ``time_step.process_dt``:
bias added, softplus (the identity above 20 in the kernel; torch's threshold is 20 too), and the
clamp to dt_limit, on both sides of every bend."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from replayserve.ops.time_step import process_dt as process_dt_ref
from replayserve.ops.time_step_triton import process_dt

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _process_dt_kernel(dt_ptr, bias_ptr, out_ptr, n, dt_min, dt_max, SOFTPLUS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    dt = tl.load(dt_ptr + offs, mask=mask, other=0.0)
    bias = tl.load(bias_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, process_dt(dt, bias, dt_min, dt_max, SOFTPLUS), mask=mask)


@pytest.mark.parametrize("softplus", [True, False])
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (1e-3, 0.5), (0.01, 30.0)])
def test_process_dt_twin_equals_the_reference(softplus: bool, dt_limit: tuple[float, float]) -> None:
    dt = torch.tensor([-30.0, -5.0, -0.1, 0.0, 0.3, 2.0, 19.9, 20.0, 20.1, 25.0, 40.0], device=DEVICE)
    bias = torch.linspace(-0.5, 0.5, dt.numel(), device=DEVICE)
    out = torch.empty_like(dt)
    _process_dt_kernel[(1,)](dt, bias, out, dt.numel(), float(dt_limit[0]), float(dt_limit[1]), SOFTPLUS=softplus,
                             BLOCK=triton.next_power_of_2(dt.numel()))
    want = process_dt_ref(dt.double(), bias.double(), softplus, dt_limit)
    torch.testing.assert_close(out.double(), want, rtol=1e-6, atol=1e-7)
