"""Triton RoPE on queries and keys in place, one launch for both (``apply_rope_ref`` takes about ten
kernels per tensor: the angles, cos and sin, the rotate-half concat, two products and a sum).

Each program rotates one head of one token: it computes that token's angles from its position (no
tables), rounds cos and sin to x's dtype as transformers does, and rotates in fp32 with one rounding
at the end (the reference rounds each product and the sum in x's dtype: equal in fp32, within an ulp
in bf16). Grid and arguments depend on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, inv_freq_ptr, num_q_heads, half,
                 s_q_t, s_q_h, s_k_t, s_k_h, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if head < num_q_heads:
        base = q_ptr + t * s_q_t + head * s_q_h
    else:
        base = k_ptr + t * s_k_t + (head - num_q_heads) * s_k_h
    offs = tl.arange(0, BLOCK)
    mask = offs < half
    angle = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + offs, mask=mask, other=0.0)
    dtype = base.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)
    sin = tl.sin(angle).to(dtype).to(tl.float32)
    x1 = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(base + offs, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(base + half + offs, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def apply_rope_qk_triton_(q: Tensor, k: Tensor, positions: Tensor, inv_freq: Tensor) -> tuple[Tensor, Tensor]:
    """``apply_rope_ref`` of q and of k, IN PLACE, in one launch.

    Arguments:
        q: (T, H, D) fp32, bf16 or fp16, unit stride in the last dimension.
        k: (T, Hkv, D) in q's dtype, likewise.
        positions: (T,) integer absolute positions.
        inv_freq: (R / 2,) float32 contiguous, R <= D.

    Returns:
        (q, k), rotated over their first R dimensions.
    """
    if q.stride(-1) != 1 or k.stride(-1) != 1 or k.dtype != q.dtype:
        raise ValueError("apply_rope_qk_triton_ needs q and k of one dtype with unit stride in the head dimension")
    num_tokens, num_q_heads, _ = q.shape
    half = inv_freq.numel()
    if num_tokens:
        _rope_kernel[(num_tokens, num_q_heads + k.shape[1])](
            q, k, positions, inv_freq.contiguous(), num_q_heads, half, q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), BLOCK=triton.next_power_of_2(half), num_warps=1)
    return q, k
