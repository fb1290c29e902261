"""The Gated DeltaNet gates from the projections' b and a: the reference, and the entry point that
runs ``gdn_gates_triton``'s one kernel where it serves (``dispatch.use_triton``); PyTorch takes six
small kernels (exp, add, softplus, multiply, negate, sigmoid), each a launch per layer and step."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype


def gdn_gates_ref(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """The log-space decay g = -exp(A_log) * softplus(a + dt_bias) and the write strength
    beta = sigmoid(b), as transformers' Qwen3-Next and Qwen3.5 compute them.

    Arguments:
        a, b: (T, Hv) any float dtype (the projections' outputs).
        a_log, dt_bias: (Hv,) the layer's parameters.

    Returns:
        g, beta: (T, Hv) each in compute_dtype(a.dtype) (beta: b's sigmoid in b's dtype, then cast).
    """
    cdt = compute_dtype(a.dtype)
    g = -a_log.to(cdt).exp() * F.softplus(a.to(cdt) + dt_bias.to(cdt))
    return g, b.sigmoid().to(cdt)


def gdn_gates(a: Tensor, b: Tensor, a_log: Tensor, dt_bias: Tensor) -> tuple[Tensor, Tensor]:
    """``gdn_gates_ref``; one launch where the kernel serves (2-D a and b of one shape)."""
    if use_triton(a) and a.dim() == 2 and b.shape == a.shape and a_log.shape == dt_bias.shape == (a.shape[1],):
        from replayserve.ops.gdn_gates_triton import gdn_gates_triton

        return gdn_gates_triton(a, b, a_log, dt_bias)
    return gdn_gates_ref(a, b, a_log, dt_bias)
