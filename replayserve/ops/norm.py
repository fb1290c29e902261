"""RMS norms: plain, with the residual add before it, and the grouped gated variant used after the
Mamba2 scan. The references here; each entry point runs the kernel of ``norm_triton`` where it
serves (``dispatch.use_triton``): one launch instead of about ten."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension.

    Arguments:
        x: (..., D) any float dtype.
        weight: (D,).
        eps: added to the mean square before the rsqrt.

    Returns:
        (..., D) in x.dtype: (x * rsqrt(mean(x^2) + eps) * weight), all computed in
        compute_dtype(x.dtype) and cast once at the end.
    """
    cdt = compute_dtype(x.dtype)
    h = x.to(cdt)
    h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (h * weight.to(cdt)).to(x.dtype)


def gated_rms_norm_ref(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                       norm_before_gate: bool = False, round_normed: bool = False) -> Tensor:
    """Gated RMSNorm normalised per contiguous group of channels (NemotronHRMSNormGated; Falcon-H1's
    with `norm_before_gate`; Qwen3-Next's and Qwen3.5's Gated DeltaNet norm with `round_normed` too).

    Arguments:
        x: (..., D) any float dtype.
        z: (..., D) the gate.
        weight: (D,), or (group_size,) shared by every group (with `round_normed`).
        eps: added to each group's mean square before the rsqrt.
        group_size: channels per group; D % group_size == 0.
        norm_before_gate: normalise x, then gate (Falcon-H1's `mamba_norm_before_gate`).
        round_normed: with `norm_before_gate`, the Gated DeltaNet order (transformers'
            Qwen3NextRMSNormGated): the normed x rounded to x.dtype, times the weight (in their
            promoted dtype), times silu(z) in the compute dtype, cast once to x.dtype.

    Returns:
        (..., D): with h = x * silu(z) in compute_dtype(x.dtype), each group of
        ``group_size`` channels is scaled by rsqrt(mean(h^2) + eps), then
        ``weight * h.to(x.dtype)``. The cast happens before the weight multiply
        to match Hugging Face, so the dtype is torch.promote_types(weight.dtype,
        x.dtype) (x.dtype when both agree). With `norm_before_gate`, h = x normalised per
        group, then ``weight * h * silu(z)`` in the compute dtype, cast once to x.dtype (as
        transformers' FalconH1RMSNormGated).
    """
    dim = x.shape[-1]
    if z.shape != x.shape:
        raise ValueError(f"z shape {tuple(z.shape)} != x shape {tuple(x.shape)}")
    if dim % group_size != 0:
        raise ValueError(f"D={dim} is not a multiple of group_size={group_size}")
    if round_normed and not norm_before_gate:
        raise ValueError("round_normed goes with norm_before_gate")
    if weight.shape == (group_size,) and dim != group_size:
        if not round_normed:
            raise ValueError(f"weight must be ({dim},), got {tuple(weight.shape)}")
        weight = weight.repeat(dim // group_size)
    cdt = compute_dtype(x.dtype)
    gate = F.silu(z.to(cdt))
    h = x.to(cdt) if norm_before_gate else x.to(cdt) * gate
    groups = h.reshape(*h.shape[:-1], dim // group_size, group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(dim=-1, keepdim=True) + eps)
    h = groups.reshape(h.shape)
    if round_normed:
        return ((weight * h.to(x.dtype)) * gate).to(x.dtype)
    if norm_before_gate:
        return (weight * h * gate).to(x.dtype)
    return weight * h.to(x.dtype)


def add_rms_norm_ref(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """A residual add followed by RMSNorm of the sum (the pre-norm of the next block).

    Arguments:
        x: (..., D) the block's output, any float dtype.
        residual: (..., D) the residual stream, possibly kept wider than x (fp32 with bf16 x).
        weight: (D,).
        eps: as in ``rms_norm_ref``.

    Returns:
        normed: (..., D) in x.dtype, ``rms_norm_ref`` of the stored sum (so exactly what the
            unfused ``residual = x + residual; norm(residual)`` gives), cast to x.dtype.
        residual: (..., D) in residual.dtype, x + residual summed in
            compute_dtype(promote_types(x.dtype, residual.dtype)).
    """
    if residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    cdt = compute_dtype(torch.promote_types(x.dtype, residual.dtype))
    summed = (x.to(cdt) + residual.to(cdt)).to(residual.dtype)
    return rms_norm_ref(summed, weight, eps).to(x.dtype), summed


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``rms_norm_ref``, by its kernel where it serves."""
    if use_triton(x):
        from replayserve.ops.norm_triton import rms_norm_triton

        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``add_rms_norm_ref``, by its kernel where it serves."""
    if use_triton(x):
        from replayserve.ops.norm_triton import add_rms_norm_triton

        return add_rms_norm_triton(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                   norm_before_gate: bool = False, round_normed: bool = False) -> Tensor:
    """``gated_rms_norm_ref``, by its kernel where it serves."""
    if use_triton(x):
        from replayserve.ops.norm_triton import gated_rms_norm_triton

        return gated_rms_norm_triton(x, z, weight, eps, group_size, norm_before_gate, round_normed)
    return gated_rms_norm_ref(x, z, weight, eps, group_size, norm_before_gate, round_normed)
