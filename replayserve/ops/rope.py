"""Rotary position embedding (RoPE), the rotate-half form of Hugging Face's Llama-style models: the
references, and ``apply_rope_qk``, which runs ``rope_triton``'s one launch for q and k where it
serves (``dispatch.use_triton``) and the reference on the step's shared cos / sin elsewhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> Tensor:
    """(rotary_dim / 2,) float32 inverse frequencies theta^(-2i / rotary_dim), as transformers computes
    them, made on `device` by kernels there (no host copy: safe inside a CUDA-graph capture)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


def rope_cos_sin_ref(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(T, R) cos and sin of positions * inv_freq (each frequency twice, rotate-half order): the angles
    in float32, cos / sin cast to `dtype`, as transformers computes them. positions (T,) int64,
    inv_freq (R / 2,) float32. Every layer of a step shares them (`StepContext.rope_tables`)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope_cos_sin_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotates the first R dimensions of each head by `rope_cos_sin_ref`'s (T, R) cos and sin; the
    rest pass through. x (T, H, D), R <= D even -> (T, H, D) in x.dtype."""
    rot_dim = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    rot = x[..., :rot_dim]
    half = rot_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos + rotated * sin
    return out if rot_dim == x.shape[-1] else torch.cat((out, x[..., rot_dim:]), dim=-1)


def apply_rope_ref(x: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """Rotates the first 2 * len(inv_freq) dimensions of each head; the rest pass through.

    Arguments:
        x: (T, H, D) queries or keys, any float dtype.
        positions: (T,) int64 absolute positions.
        inv_freq: (R / 2,) float32, R <= D even.

    Returns:
        (T, H, D) in x.dtype. The angles are computed in float32 and cos / sin cast to x.dtype
        before the rotation, as transformers does.
    """
    return apply_rope_cos_sin_ref(x, *rope_cos_sin_ref(positions.to(x.device), inv_freq, x.dtype))


def apply_rope_qk(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor,
                  cos_sin: Callable[[], tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """q (T, H, D) and k (T, Hkv, D) rotated as ``apply_rope_ref`` rotates each: by the kernel, in
    place, where it serves (q and k then must not be read unrotated afterwards); else by the
    reference on `cos_sin()`, the step's (T, R) ``rope_cos_sin_ref`` tables in q's dtype."""
    if use_triton(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
        from replayserve.ops.rope_triton import apply_rope_qk_triton_

        return apply_rope_qk_triton_(q, k, positions, inv_freq)
    cos, sin = cos_sin()
    return apply_rope_cos_sin_ref(q, cos, sin), apply_rope_cos_sin_ref(k, cos, sin)
