"""Triton Gated DeltaNet gates: match ``gdn_gates_ref`` of ``replayserve.ops.gdn_gates`` in one launch.

One program per row (its heads): g = -exp(A_log) * softplus(a + dt_bias) in fp32, with
PyTorch's softplus (the input itself above 20, else log1p(exp(x))), and beta = sigmoid(b) rounded to
b's dtype first, as the reference rounds it. The grid depends on the shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gdn_gates_kernel(a_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, heads, s_a_t, s_b_t,
                      BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    mask = h < heads
    offs = t * heads + h
    a = tl.load(a_ptr + t * s_a_t + h, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * s_b_t + h, mask=mask, other=0.0)
    x = a + tl.load(dt_bias_ptr + h, mask=mask, other=0.0).to(tl.float32)
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y  # log1p(y) as log(u) * y / (u - 1) (Goldberg): a few ulps, where log(1 + y) loses y's digits
    log1p = tl.where(u == 1.0, y, tl.log(u) * (y / tl.where(u == 1.0, 1.0, u - 1.0)))
    softplus = tl.where(x > 20.0, x, log1p)
    g = -tl.exp(tl.load(a_log_ptr + h, mask=mask, other=0.0).to(tl.float32)) * softplus
    beta = tl.sigmoid(b.to(tl.float32)).to(b_ptr.dtype.element_ty).to(tl.float32)
    tl.store(g_ptr + offs, g, mask=mask)
    tl.store(beta_ptr + offs, beta, mask=mask)


def gdn_gates_triton(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``gdn_gates_ref`` on the GPU: a, b (T, Hv) fp32, bf16 or fp16 with unit head stride (rows may be
    strided); a_log, dt_bias (Hv,) contiguous. Returns g, beta (T, Hv) contiguous fp32."""
    if a.stride(1) != 1 or b.stride(1) != 1:
        a, b = a.contiguous(), b.contiguous()
    rows, heads = a.shape
    g = torch.empty(rows, heads, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if rows == 0:
        return g, beta
    # One program a row: the variant depends on the head count only, not on the step's rows (no
    # compile while serving).
    _gdn_gates_kernel[(rows,)](a, b, a_log.contiguous(), dt_bias.contiguous(), g, beta, heads, a.stride(0),
                               b.stride(0), BLOCK=triton.next_power_of_2(heads), num_warps=1)
    return g, beta
