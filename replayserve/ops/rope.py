"""Rotary position embedding (RoPE), the rotate-half form of Hugging Face's Llama-style models.

A plain-PyTorch reference only: it runs once per attention layer on q and k, a few elementwise
kernels beside the projections' GEMMs.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rope_inv_freq(rotary_dim: int, theta: float, device: torch.device | str = "cpu") -> Tensor:
    """(rotary_dim / 2,) float32 inverse frequencies theta^(-2i / rotary_dim), as transformers computes
    them, made on `device` by kernels there (no host copy: safe inside a CUDA-graph capture)."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=device) / rotary_dim))


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
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(device=x.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(x.dtype)[:, None, :], emb.sin().to(x.dtype)[:, None, :]
    rot_dim = emb.shape[-1]
    rot, rest = x[..., :rot_dim], x[..., rot_dim:]
    half = rot_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
