"""The ReplaySSM-GDN decode read (one token per row) in two kernels: what a value head's columns share
is computed once per key head, then each (K, BLOCK_V) tile of the checkpoint is read by one program.

Matches the T = 1 case of ``replay_gdn_step_ref`` (and of ``replay_gdn_triton``'s fused read kernel),
math as in ``replay_gdn_triton``'s docstring. For the token at logical entry m (m = history):
    delta = beta (v - a_k S0^T k - sum_{j<m} w_k[j] delta_j)
    o     = a_q S0^T q + sum_{j<m} w_q[j] delta_j + c delta
with r the inverse key / query norms (the query's times the scale), G the cumulative decays and
    w_k[j] = r_k r_j exp(G_m - G_j) (k.k_j),  w_q[j] = r_q r_j exp(G_m - G_j) (q.k_j),
    a_k = exp(G_m) r_k,  a_q = exp(G_m) r_q,  c = r_q r_k (q.k).

- The coefficient kernel (one program per key head and row) reads the history's keys (E, K) once,
  takes their products with the token's k and q and their norms, appends the token's key and each
  value head's g, and writes (w_k, w_q, a_k, a_q, c) per value head.
- The tile kernel (one program per V block, value head and row, as the baseline step) reads its S0
  tile and the history's deltas for its columns, and appends the token's delta.

Why two: in the fused read kernel each of those programs recomputed the (E, K) key products that the
V blocks and value heads of a key head share: 3 E K multiply-adds (and as many cross-thread sums)
against the tile's own 2 K BLOCK_V, 8 times over at the Qwen3.5 shape (4 V blocks, 2 value heads
per key head). The extra launch reads the keys once: at batch 256 a few % of the tiles' bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _replay_gdn_coef_kernel(
    k_ring_ptr, g_ring_ptr, ring_start_ptr, history_ptr, slots_ptr, q_ptr, k_ptr, g_ptr, coef_ptr,
    scale, ring_len, dk, heads_per_key,
    s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_gr_slot, s_gr_h, s_gr_e,
    s_q_b, s_q_h, s_q_k, s_k_b, s_k_h, s_k_k, s_g_b, s_g_h, s_c_b, s_c_h,
    L2NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):
    hk = tl.program_id(0)
    row = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: the tile kernel writes its zeros without reading coefficients
        return
    m = tl.load(history_ptr + slot).to(tl.int32)
    start = tl.load(ring_start_ptr + slot).to(tl.int32)
    offs_e, offs_k = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    mask_k = offs_k < dk
    old = offs_e < m
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    phys_new = start + m  # m + 1 <= R: the append never lands on the history
    phys_new = tl.where(phys_new >= ring_len, phys_new - ring_len, phys_new)

    kr = k_ring_ptr + slot * s_kr_slot + hk * s_kr_h
    k_old = tl.load(kr + phys[:, None] * s_kr_e + offs_k[None, :] * s_kr_k, mask=old[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
    k_raw = tl.load(k_ptr + row * s_k_b + hk * s_k_h + offs_k * s_k_k, mask=mask_k, other=0.0)
    k_raw = k_raw.to(k_ring_ptr.dtype.element_ty)  # the key as the ring gives it back
    k_new = k_raw.to(tl.float32)
    q = tl.load(q_ptr + row * s_q_b + hk * s_q_h + offs_k * s_q_k, mask=mask_k, other=0.0).to(tl.float32)
    tl.store(kr + phys_new * s_kr_e + offs_k * s_kr_k, k_raw, mask=mask_k)

    kk = tl.sum(k_old * k_new[None, :], axis=1)  # (E,) k . k_j
    qk = tl.sum(k_old * q[None, :], axis=1)  # (E,) q . k_j
    qkn = tl.sum(q * k_new)
    if L2NORM:  # l2norm_ref's scale: 1 / sqrt(sum(x^2) + 1e-6)
        r_old = 1.0 / tl.sqrt(tl.sum(k_old * k_old, axis=1) + 1e-6)
        r_k = 1.0 / tl.sqrt(tl.sum(k_new * k_new) + 1e-6)
        r_q = scale / tl.sqrt(tl.sum(q * q) + 1e-6)
    else:
        r_old = tl.full([BLOCK_E], 1.0, tl.float32)
        r_k = 1.0
        r_q = scale
    kk = kk * r_old * r_k
    qk = qk * r_old * r_q

    for j in tl.range(0, heads_per_key):  # the key head's value heads: their own decays
        h = hk * heads_per_key + j
        gr = g_ring_ptr + slot * s_gr_slot + h * s_gr_h
        g_old = tl.load(gr + phys * s_gr_e, mask=old, other=0.0).to(tl.float32)
        g_raw = tl.load(g_ptr + row * s_g_b + h * s_g_h).to(g_ring_ptr.dtype.element_ty)
        tl.store(gr + phys_new * s_gr_e, g_raw)
        cum_new = tl.sum(g_old) + g_raw.to(tl.float32)  # G_m
        # exp(G_m - G_j) for j < m, exponents <= 0: never a ratio of exps
        decays = tl.where(old, tl.exp(tl.where(old, cum_new - tl.cumsum(g_old, 0), 0.0)), 0.0)
        decay = tl.exp(cum_new)
        out = coef_ptr + row * s_c_b + h * s_c_h
        tl.store(out + offs_e, kk * decays)
        tl.store(out + BLOCK_E + offs_e, qk * decays)
        tl.store(out + 2 * BLOCK_E, decay * r_k)
        tl.store(out + 2 * BLOCK_E + 1, decay * r_q)
        tl.store(out + 2 * BLOCK_E + 2, r_q * r_k * qkn)


@triton.jit
def _replay_gdn_tile_kernel(
    state_ptr, d_ring_ptr, ring_start_ptr, history_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, beta_ptr, coef_ptr, o_ptr,
    ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
    s_q_b, s_q_h, s_q_k, s_k_b, s_k_h, s_k_k, s_v_b, s_v_h, s_v_v, s_be_b, s_be_h, s_c_b, s_c_h, s_o_b, s_o_h, s_o_v,
    K_RING_DTYPE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    offs_e, offs_k = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    o_out = o_ptr + row * s_o_b + h * s_o_h + offs_v * s_o_v
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: nothing read or written but zero outputs
        tl.store(o_out, tl.zeros([BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_v)
        return
    m = tl.load(history_ptr + slot).to(tl.int32)
    start = tl.load(ring_start_ptr + slot).to(tl.int32)
    old = offs_e < m
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    phys_new = start + m
    phys_new = tl.where(phys_new >= ring_len, phys_new - ring_len, phys_new)
    hk = h // heads_per_key

    s0 = tl.load(state_ptr + slot * s_st_slot + h * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v,
                 mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    dr = d_ring_ptr + slot * s_dr_slot + h * s_dr_h
    d_old = tl.load(dr + phys[:, None] * s_dr_e + offs_v[None, :] * s_dr_v, mask=old[:, None] & mask_v[None, :],
                    other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * s_k_b + hk * s_k_h + offs_k * s_k_k, mask=mask_k, other=0.0)
    k = k.to(K_RING_DTYPE).to(tl.float32)  # as the ring gives the key back (the coefficients' k)
    q = tl.load(q_ptr + row * s_q_b + hk * s_q_h + offs_k * s_q_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * s_v_b + h * s_v_h + offs_v * s_v_v, mask=mask_v, other=0.0).to(tl.float32)
    beta = tl.load(beta_ptr + row * s_be_b + h * s_be_h).to(tl.float32)
    cf = coef_ptr + row * s_c_b + h * s_c_h
    w_k = tl.load(cf + offs_e)
    w_q = tl.load(cf + BLOCK_E + offs_e)
    a_k = tl.load(cf + 2 * BLOCK_E)
    a_q = tl.load(cf + 2 * BLOCK_E + 1)
    c = tl.load(cf + 2 * BLOCK_E + 2)

    ks = tl.sum(s0 * k[:, None], axis=0)  # S0^T k over the tile's columns
    qs = tl.sum(s0 * q[:, None], axis=0)
    delta = beta * (v - a_k * ks - tl.sum(w_k[:, None] * d_old, axis=0))
    delta = delta.to(d_ring_ptr.dtype.element_ty)
    tl.store(dr + phys_new * s_dr_e + offs_v * s_dr_v, delta, mask=mask_v)
    delta = delta.to(tl.float32)  # outputs use the value the ring stores
    o = a_q * qs + tl.sum(w_q[:, None] * d_old, axis=0) + c * delta
    tl.store(o_out, o.to(o_ptr.dtype.element_ty), mask=mask_v)


def replay_gdn_decode_read(
    state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor, ring_start: Tensor, history: Tensor,
    slots: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, use_qk_l2norm: bool,
    block_v: int,
) -> Tensor:
    """The read of one decode token per row, rings appended, nothing flushed: o (rows, 1, Hv, V) in v's
    dtype. Shapes as ``replay_gdn_step_triton`` with T = 1 (checked there); every row's n is 1."""
    (hv, dk, dv), hk, ring_len = state.shape[1:], k_ring.shape[1], g_ring.shape[2]
    rows = v.shape[0]
    block_e = max(16, triton.next_power_of_2(ring_len))
    block_k = max(16, triton.next_power_of_2(dk))
    coef = torch.empty(rows, hv, 2 * block_e + 4, dtype=torch.float32, device=v.device)
    q1, k1, v1, g1, beta1 = q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0]
    _replay_gdn_coef_kernel[(hk, rows)](
        k_ring, g_ring, ring_start, history, slots, q1, k1, g1, coef, scale, ring_len, dk, hv // hk,
        *k_ring.stride(), *g_ring.stride(), *q1.stride(), *k1.stride(), *g1.stride(), *coef.stride()[:2],
        L2NORM=use_qk_l2norm, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
    )
    o = torch.empty_like(v)
    o1 = o[:, 0]
    _replay_gdn_tile_kernel[(triton.cdiv(dv, block_v), hv, rows)](
        state, delta_ring, ring_start, history, slots, q1, k1, v1, beta1, coef, o1, ring_len, dk, dv, hv // hk,
        *state.stride(), *delta_ring.stride(), *q1.stride(), *k1.stride(), *v1.stride(), *beta1.stride(),
        *coef.stride()[:2], *o1.stride(),
        K_RING_DTYPE=_TL_DTYPES[k_ring.dtype], BLOCK_E=block_e, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=4,
    )
    return o


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float64: tl.float64}
