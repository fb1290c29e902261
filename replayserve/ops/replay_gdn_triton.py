"""Triton ReplaySSM kernels for Gated DeltaNet: match ``replay_gdn_step_ref`` and
``replay_gdn_materialize_ref`` of ``replayserve.ops.replay_gdn`` (math: docs/replayssm.md, Gated DeltaNet).

The rings hold each token's correction delta_j (``replay_gdn`` module docstring), so the state after
entries 0..i is exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j delta_j^T, with no system to solve over
the history. State columns never exchange anything, so the work is cut into (K, BLOCK_V) tiles of
S0, each read by exactly one program, as in the baseline step.

- The read kernel (one program per V block, value head and row) computes, for the step's n tokens
  at logical entries m..m+n-1 (m = history):
      delta_t = beta_t (v_t - exp(G_t) S0^T k_t - sum_{j<m+t} exp(G_t - G_j) (k_t.k_j) delta_j)
      o_t     = exp(G_t) S0^T q_t + sum_{j<=m+t} exp(G_t - G_j) (q_t.k_j) delta_j
  The history's terms are one (T, E) x (E, BLOCK_V) product; the new tokens' deltas depend on one
  another through a (T, T) unit lower-triangular system, solved row by row (no work when T = 1).
  S0 is read once, with both q and k of the new tokens, and never written. It appends each token's
  (k, delta, g) and always replays from S0 (flush or not), so the flush can run after it.
- The fold writes S1 = exp(G_last) S0 + K~^T Delta (K~_j = exp(G_last - G_j) k_j), one
  (K, E) x (E, BLOCK_V) product per tile (``_fold_tile``). The flush kernel (rows whose `is_flush` is
  set, entries 0..history-1, in place) runs a fixed grid of persistent programs that list the
  step's flushing rows (about one in W) and share out their tiles, as the Mamba2 flush does; a
  program per (row, head) would hold an SM's registers even for the rows that leave at once. The
  materialization kernel (src -> dst) runs one program per tile.

Products are tensor-core `tl.dot`s in ``PRECISION`` (``tf32x3``: three TF32 products, close to fp32,
as the Mamba2 flush) wherever every dimension is >= 16: all of the fold's and, with T > 1 (the
query rows padded to 16), all of the read's, over K in chunks of 32 so that the padded query rows
each warp holds stay small. A decode step (T = 1) has one query row, where a dot would pad 15 rows
of zeros: there, as in the baseline step, products are summed on the CUDA cores (about 2 (K + E)
FMAs per state column against the baseline's 4 K), in one chunk. Built for sm_90 (Triton 3.7, K =
V = 128, E = 32), the read kernel takes 168 registers at T = 1 (the baseline step 203) and 239 at
T > 1 (8 warps), the flush 255 (4 warps), materialization 122 (8 warps), none spilling. Launch
sizes are not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.replay_flush_triton import flushing_rows
from replayserve.ops.replay_gdn_decode_triton import replay_gdn_decode_read


@triton.jit
def _mm(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a (M, N) @ b (N, P) in fp32: tl.dot if DOT (every dimension >= 16), else (M = 1) a column of
    a times b summed over N on the CUDA cores, in b's own layout (no 3-D product to re-lay b into)."""
    if DOT:
        return tl.dot(a, b, input_precision=PRECISION)
    else:
        return tl.sum(tl.trans(a) * b, axis=0)[None, :]


@triton.jit
def _mm_t(a, b, DOT: tl.constexpr, PRECISION: tl.constexpr):
    """a (M, N) @ b^T for b (P, N), as ``_mm``; rows of b (keys) are used as they were loaded."""
    if DOT:
        return tl.dot(a, tl.trans(b), input_precision=PRECISION)
    else:
        return tl.sum(a * b, axis=1)[None, :]


@triton.jit
def _normalized(x, L2NORM: tl.constexpr):
    """Rows of x L2-normalized as l2norm_ref (x / sqrt(sum(x^2) + 1e-6)); all-zero rows stay zero."""
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _inv_norm(sum_sq, L2NORM: tl.constexpr):
    """1 / sqrt(sum(x^2) + 1e-6), the scale of l2norm_ref, or 1 where the layer does not normalize."""
    if L2NORM:
        return 1.0 / tl.sqrt(sum_sq + 1e-6)
    else:
        return sum_sq * 0.0 + 1.0


@triton.jit
def _decays(cum_to, cum_from, mask):
    """exp(cum_to[i] - cum_from[j]) where mask (exponents <= 0 there), else 0: never a ratio of exps."""
    return tl.where(mask, tl.exp(tl.where(mask, cum_to[:, None] - cum_from[None, :], 0.0)), 0.0)


@triton.jit
def _replay_gdn_read_kernel(
    state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, ring_start_ptr, history_ptr, slots_ptr, ntok_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    scale, tokens, ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
    s_gr_slot, s_gr_h, s_gr_e,
    s_q_b, s_q_t, s_q_h, s_q_k, s_k_b, s_k_t, s_k_h, s_k_k, s_v_b, s_v_t, s_v_h, s_v_v,
    s_g_b, s_g_t, s_g_h, s_be_b, s_be_t, s_be_h, s_o_b, s_o_t, s_o_h, s_o_v,
    L2NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_V: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    offs_e, offs_t = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_T)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < dv
    o_tile = o_ptr + row * s_o_b + offs_t[:, None] * s_o_t + h * s_o_h + offs_v[None, :] * s_o_v
    mask_o = (offs_t < tokens)[:, None] & mask_v[None, :]
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: nothing read or written but zero outputs
        tl.store(o_tile, tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=mask_o)
        return
    n = tl.load(ntok_ptr + row).to(tl.int32)
    m = tl.load(history_ptr + slot).to(tl.int32)
    start = tl.load(ring_start_ptr + slot).to(tl.int32)
    hk = h // heads_per_key
    kr = k_ring_ptr + slot * s_kr_slot + hk * s_kr_h
    dr = d_ring_ptr + slot * s_dr_slot + h * s_dr_h
    gr = g_ring_ptr + slot * s_gr_slot + h * s_gr_h
    k_in = k_ptr + row * s_k_b + hk * s_k_h
    q_in = q_ptr + row * s_q_b + hk * s_q_h
    st = state_ptr + slot * s_st_slot + h * s_st_h
    g_in = g_ptr + row * s_g_b + h * s_g_h
    writes_key = (pid_v == 0) & (h % heads_per_key == 0)  # one program per key head appends the shared key

    # The history: logical entries j < m at physical (start + j) mod R. The step's tokens are rounded
    # to the rings' dtypes, as the next steps will read them back.
    old = offs_e < m
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    mask_t = offs_t < n
    phys_new = start + m + offs_t  # appends at logical entries m..m+n-1: m + n <= R, never on the history
    phys_new = tl.where(phys_new >= ring_len, phys_new - ring_len, phys_new)

    # Everything read besides the K-wide operands is loaded first: the loop below stores the step's keys
    # into the ring, and loads after a store cannot be moved above it, which would leave two rounds of
    # memory latency in a decode program.
    g_old = tl.load(gr + phys * s_gr_e, mask=old, other=0.0).to(tl.float32)
    d_old = tl.load(dr + phys[:, None] * s_dr_e + offs_v[None, :] * s_dr_v,
                    mask=old[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    mask_tv = mask_t[:, None] & mask_v[None, :]
    g_raw = tl.load(g_in + offs_t * s_g_t, mask=mask_t, other=0.0).to(g_ring_ptr.dtype.element_ty)
    beta = tl.load(beta_ptr + row * s_be_b + offs_t * s_be_t + h * s_be_h, mask=mask_t, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * s_v_b + offs_t[:, None] * s_v_t + h * s_v_h + offs_v[None, :] * s_v_v,
                mask=mask_tv, other=0.0).to(tl.float32)

    # Every product over K, in chunks of BLOCK_C columns: one chunk for a decode step; with T > 1,
    # chunks keep small the tl.dot operands that each warp holds whole (16 x BLOCK_C query rows).
    # Keys are L2-normalized by scaling the products (bilinear in the keys) once the norms are summed.
    kk_old = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)  # k_t . k_j
    qk_old = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)  # q_t . k_j
    kk_new = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)  # k_t . k_u
    qk_new = tl.zeros([BLOCK_T, BLOCK_T], dtype=tl.float32)  # q_t . k_u
    ks = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)  # S0^T k_t
    qs = tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32)  # S0^T q_t
    ss_old = tl.zeros([BLOCK_E], dtype=tl.float32)
    ss_new = tl.zeros([BLOCK_T], dtype=tl.float32)
    ss_q = tl.zeros([BLOCK_T], dtype=tl.float32)
    for kc in tl.range(0, BLOCK_K, BLOCK_C):
        offs_c = kc + tl.arange(0, BLOCK_C)
        mask_c = offs_c < dk
        mask_tc = mask_t[:, None] & mask_c[None, :]
        k_old = tl.load(kr + phys[:, None] * s_kr_e + offs_c[None, :] * s_kr_k, mask=old[:, None] & mask_c[None, :],
                        other=0.0).to(tl.float32)
        k_raw = tl.load(k_in + offs_t[:, None] * s_k_t + offs_c[None, :] * s_k_k, mask=mask_tc, other=0.0)
        k_raw = k_raw.to(k_ring_ptr.dtype.element_ty)
        k_new = k_raw.to(tl.float32)
        q = tl.load(q_in + offs_t[:, None] * s_q_t + offs_c[None, :] * s_q_k, mask=mask_tc, other=0.0).to(tl.float32)
        s0 = tl.load(st + offs_c[:, None] * s_st_k + offs_v[None, :] * s_st_v, mask=mask_c[:, None] & mask_v[None, :],
                     other=0.0).to(tl.float32)
        kk_old += _mm_t(k_new, k_old, DOT, PRECISION)
        qk_old += _mm_t(q, k_old, DOT, PRECISION)
        if DOT:  # a decode step's one token has no earlier new token
            kk_new += _mm_t(k_new, k_new, DOT, PRECISION)
        qk_new += _mm_t(q, k_new, DOT, PRECISION)
        ks += _mm(k_new, s0, DOT, PRECISION)
        qs += _mm(q, s0, DOT, PRECISION)
        if L2NORM:
            ss_old += tl.sum(k_old * k_old, axis=1)
            ss_new += tl.sum(k_new * k_new, axis=1)
            ss_q += tl.sum(q * q, axis=1)
        if writes_key:
            tl.store(kr + phys_new[:, None] * s_kr_e + offs_c[None, :] * s_kr_k, k_raw, mask=mask_tc)
    r_old = _inv_norm(ss_old, L2NORM)
    r_new = _inv_norm(ss_new, L2NORM)
    r_q = _inv_norm(ss_q, L2NORM) * scale

    # Cumulative decays from the origin: G_j of the history, G_t of the new tokens (t at entry m + t).
    cum_old = tl.cumsum(g_old, 0)
    cum_new = tl.sum(g_old) + tl.cumsum(g_raw.to(tl.float32), 0)
    decay = tl.exp(cum_new)[:, None]
    kk_old *= r_new[:, None] * r_old[None, :] * _decays(cum_new, cum_old, old[None, :])
    qk_old *= r_q[:, None] * r_old[None, :] * _decays(cum_new, cum_old, old[None, :])
    qk_new *= r_q[:, None] * r_new[None, :] * _decays(cum_new, cum_new, offs_t[None, :] <= offs_t[:, None])

    # delta_t: S0's and the history's terms, then (T > 1) the earlier new tokens' in order.
    delta = beta[:, None] * (v - decay * r_new[:, None] * ks - _mm(kk_old, d_old, DOT, PRECISION))
    if DOT:  # delta_t also subtracts beta_t sum_{u<t} exp(G_t - G_u) (k_t.k_u) delta_u
        strict = offs_t[None, :] < offs_t[:, None]
        a_new = kk_new * (r_new[:, None] * r_new[None, :] * beta[:, None]) * _decays(cum_new, cum_new, strict)
        first = delta
        for t in range(1, n):  # rows u < t are final
            delta = tl.where(offs_t[:, None] == t, first - tl.dot(a_new, delta, input_precision=PRECISION), delta)
    delta = delta.to(d_ring_ptr.dtype.element_ty).to(tl.float32)  # outputs use the value the ring stores
    o = decay * r_q[:, None] * qs + _mm(qk_old, d_old, DOT, PRECISION) + _mm(qk_new, delta, DOT, PRECISION)
    tl.store(o_tile, tl.where(mask_t[:, None], o, 0.0).to(o_ptr.dtype.element_ty), mask=mask_o)

    tl.store(dr + phys_new[:, None] * s_dr_e + offs_v[None, :] * s_dr_v, delta.to(d_ring_ptr.dtype.element_ty),
             mask=mask_tv)
    if pid_v == 0:
        tl.store(gr + phys_new * s_gr_e, g_raw, mask=mask_t)


@triton.jit
def _fold_tile(
    state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, src, dst, h, offs_v, n, start, ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
    s_gr_slot, s_gr_h, s_gr_e,
    L2NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
):
    """state[dst] columns offs_v = the fold of state[src]'s with src's ring entries 0..n-1 from `start`:
    S1 = exp(G_last) S0 + K~^T Delta, K~_j = exp(G_last - G_j) k_j; the source tile is read first."""
    offs_e, offs_k = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    mask_k, mask_v = offs_k < dk, offs_v < dv
    live = offs_e < n
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    k = _normalized(tl.load(k_ring_ptr + src * s_kr_slot + (h // heads_per_key) * s_kr_h + phys[:, None] * s_kr_e
                            + offs_k[None, :] * s_kr_k, mask=live[:, None] & mask_k[None, :], other=0.0).to(tl.float32),
                    L2NORM)
    g = tl.load(g_ring_ptr + src * s_gr_slot + h * s_gr_h + phys * s_gr_e, mask=live, other=0.0).to(tl.float32)
    delta = tl.load(d_ring_ptr + src * s_dr_slot + h * s_dr_h + phys[:, None] * s_dr_e + offs_v[None, :] * s_dr_v,
                    mask=live[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
    last = tl.sum(g)
    k_to_end = tl.trans(k * tl.where(live, tl.exp(last - tl.cumsum(g, 0)), 0.0)[:, None])  # (K, E)
    tile = h * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
    mask_kv = mask_k[:, None] & mask_v[None, :]
    s0 = tl.load(state_ptr + src * s_st_slot + tile, mask=mask_kv, other=0.0).to(tl.float32)
    s1 = tl.exp(last) * s0 + tl.dot(k_to_end, delta, input_precision=PRECISION)
    tl.store(state_ptr + dst * s_st_slot + tile, s1.to(state_ptr.dtype.element_ty), mask=mask_kv)


# `rows` changes every step; BLOCK_ROWS follows it, and not specialising on its value lets an
# eager step of any row count reuse the variant of its CUDA-graph bucket (as ``replay_flush_triton``).
@triton.jit(do_not_specialize=["rows"])
def _replay_gdn_flush_kernel(
    state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, ring_start_ptr, history_ptr, is_flush_ptr, slots_ptr,
    rows, ring_len, dk, dv, num_heads, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
    s_gr_slot, s_gr_h, s_gr_e,
    L2NORM: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    # Persistent programs, as the Mamba2 flush's: each lists the step's flushing rows (about one in W:
    # a few hundred flags), the f-th being the row where the running count reaches f + 1, then takes
    # (flushing row, head, V tile) items in turn. No program is spent on a row that does not flush.
    safe, flush, rank, count = flushing_rows(slots_ptr, is_flush_ptr, history_ptr, rows, BLOCK_ROWS)
    v_tiles = tl.cdiv(dv, BLOCK_V)
    per_row = num_heads * v_tiles
    for item in tl.range(tl.program_id(0), count * per_row, tl.num_programs(0), num_stages=1):
        slot = tl.sum(tl.where(flush & (rank == item // per_row + 1), safe, 0), axis=0)
        h = (item % per_row) // v_tiles
        offs_v = (item % v_tiles) * BLOCK_V + tl.arange(0, BLOCK_V)
        _fold_tile(state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, slot, slot, h, offs_v,
                   tl.load(history_ptr + slot).to(tl.int32), tl.load(ring_start_ptr + slot).to(tl.int32),
                   ring_len, dk, dv, heads_per_key, s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e,
                   s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v, s_gr_slot, s_gr_h, s_gr_e,
                   L2NORM, BLOCK_E, BLOCK_K, PRECISION)


@triton.jit
def _replay_gdn_materialize_kernel(
    state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, src_ptr, dst_ptr, start_ptr, n_ptr,
    ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
    s_gr_slot, s_gr_h, s_gr_e,
    L2NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    src = tl.load(src_ptr + tl.program_id(2)).to(tl.int64)
    dst = tl.load(dst_ptr + tl.program_id(2)).to(tl.int64)
    if (src < 0) | (dst < 0):
        return
    _fold_tile(state_ptr, k_ring_ptr, d_ring_ptr, g_ring_ptr, src, dst, tl.program_id(1),
               tl.program_id(0) * BLOCK_V + tl.arange(0, BLOCK_V), tl.load(n_ptr + tl.program_id(2)).to(tl.int32),
               tl.load(start_ptr + tl.program_id(2)).to(tl.int32), ring_len, dk, dv, heads_per_key,
               s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_dr_slot, s_dr_h, s_dr_e, s_dr_v,
               s_gr_slot, s_gr_h, s_gr_e, L2NORM, BLOCK_E, BLOCK_K, PRECISION)


# The products' input precision: three TF32 products per fp32 product (the interpreter computes fp32).
PRECISION = "tf32x3"


def _block_v(dk: int, dv: int, block_v: int | None) -> int:
    """Columns of S0 per tile: about 4K fp32 state elements (32 per thread at 4 warps), as the
    baseline step, whose launch reaches 92% of the copy bandwidth on the H100; tl.dot needs >= 16."""
    if block_v is None:
        block_v = max(16, min(triton.next_power_of_2(dv), 4096 // max(16, triton.next_power_of_2(dk))))
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v={block_v} must be a power of two >= 16")
    return block_v


def _pool_strides(state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor) -> list[int]:
    return [*state.stride(), *k_ring.stride(), *delta_ring.stride(), *g_ring.stride()]


def _fold_sizes(state: Tensor, g_ring: Tensor, use_qk_l2norm: bool, block_v: int) -> dict:
    return {"L2NORM": use_qk_l2norm, "BLOCK_E": max(16, triton.next_power_of_2(g_ring.shape[2])),
            "BLOCK_K": max(16, triton.next_power_of_2(state.shape[2])), "BLOCK_V": block_v, "PRECISION": PRECISION}


# Persistent flush programs per SM: at 4 warps the sm_90 build takes 255 registers (no spills), so two
# are resident on an SM. Not tuned on a GPU.
FLUSH_PROGRAMS_PER_SM = 2


def _flush(state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor, ring_start: Tensor, history: Tensor,
           is_flush: Tensor, slots: Tensor, use_qk_l2norm: bool, block_v: int) -> None:
    """Folds every flushing row's history into its checkpoint, IN PLACE: a fixed grid (a CUDA graph
    captures it) of persistent programs that share out the flushing rows' (head, V tile) items."""
    (hv, dk, dv), hk, ring_len = state.shape[1:], k_ring.shape[1], g_ring.shape[2]
    programs = 4 if state.device.type != "cuda" else (  # the interpreter: a few exercise the item loop
        torch.cuda.get_device_properties(state.device).multi_processor_count * FLUSH_PROGRAMS_PER_SM)
    _replay_gdn_flush_kernel[(programs,)](
        state, k_ring, delta_ring, g_ring, ring_start, history, is_flush, slots,
        slots.shape[0], ring_len, dk, dv, hv, hv // hk, *_pool_strides(state, k_ring, delta_ring, g_ring),
        BLOCK_ROWS=max(16, triton.next_power_of_2(slots.shape[0])),
        **_fold_sizes(state, g_ring, use_qk_l2norm, block_v), num_warps=4,
    )


def replay_gdn_step_triton(
    state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False, block_v: int | None = None, split_decode: bool = True,
) -> Tensor:
    """``replay_gdn_step_ref`` on GPU (or the Triton interpreter): the read kernel, then the flush.

    Shapes as the reference: the pool (``replay_gdn`` module docstring), cursors (S,), slots (rows,)
    int64 (-1 or a pad slot for padding), num_tokens (rows,) int, q, k (rows, T, Hk, K),
    v (rows, T, Hv, V), g, beta (rows, T, Hv). Returns o (rows, T, Hv, V) in v's dtype. The pool's
    shapes are checked by the entry point (``replay_gdn.replay_gdn_step``). block_v: state columns
    per program (None: about 4K state elements per program). split_decode: a decode step (T = 1) reads
    by ``replay_gdn_decode_triton``'s two kernels (the key products once per key head); False runs
    the fused read kernel at T = 1 too (kept to time the two side by side).
    """
    (hv, dk, dv), hk, ring_len = state.shape[1:], k_ring.shape[1], g_ring.shape[2]
    rows, tokens = v.shape[:2]
    if not 1 <= tokens <= ring_len - tokens:
        raise ValueError(f"ring length R={ring_len} must equal W + T with 1 <= T={tokens} <= W")
    if q.shape != (rows, tokens, hk, dk) or k.shape != q.shape or g.shape != (rows, tokens, hv) \
            or beta.shape != g.shape:
        raise ValueError(f"q, k must be ({rows}, {tokens}, {hk}, {dk}), g, beta ({rows}, {tokens}, {hv}); got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(g.shape)}, {tuple(beta.shape)}")
    o = torch.empty_like(v)
    if rows == 0:
        return o
    block_v = _block_v(dk, dv, block_v)
    scale = dk ** -0.5 if scale is None else scale
    if tokens == 1 and split_decode:
        o = replay_gdn_decode_read(state, k_ring, delta_ring, g_ring, ring_start, history, slots, q, k, v, g, beta,
                                   scale, use_qk_l2norm, block_v)
        _flush(state, k_ring, delta_ring, g_ring, ring_start, history, is_flush, slots, use_qk_l2norm, block_v)
        return o
    block_t = 1 if tokens == 1 else max(16, triton.next_power_of_2(tokens))
    block_k = max(16, triton.next_power_of_2(dk))
    _replay_gdn_read_kernel[(triton.cdiv(dv, block_v), hv, rows)](
        state, k_ring, delta_ring, g_ring, ring_start, history, slots, num_tokens, q, k, v, g, beta, o,
        scale, tokens, ring_len, dk, dv, hv // hk,
        *_pool_strides(state, k_ring, delta_ring, g_ring),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        L2NORM=use_qk_l2norm, BLOCK_E=max(16, triton.next_power_of_2(ring_len)), BLOCK_T=block_t,
        BLOCK_K=block_k, BLOCK_C=block_k if block_t == 1 else min(32, block_k), BLOCK_V=block_v, DOT=block_t >= 16,
        PRECISION=PRECISION, num_warps=4 if block_t == 1 else 8,  # sm_90, K = V = 128: no spills either way
    )
    _flush(state, k_ring, delta_ring, g_ring, ring_start, history, is_flush, slots, use_qk_l2norm, block_v)
    return o


def replay_gdn_materialize_triton(state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor,
                                  src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor,
                                  use_qk_l2norm: bool = False, block_v: int | None = None) -> None:
    """``replay_gdn_materialize_ref`` on GPU: src, dst (rows,) int64, ring_start, n (rows,) int32;
    block_v as in ``replay_gdn_step_triton``.

    Each program reads its source tile before writing its destination tile, so a row may fold in
    place (src == dst); a row's dst must not be another row's src.
    """
    if src.dim() != 1 or any(t.shape != src.shape for t in (dst, ring_start, n)):
        raise ValueError(f"src, dst, ring_start, n must all be (rows,), got {tuple(src.shape)}, {tuple(dst.shape)}, "
                         f"{tuple(ring_start.shape)}, {tuple(n.shape)}")
    if src.shape[0] == 0:
        return
    (hv, dk, dv), hk = state.shape[1:], k_ring.shape[1]
    block_v = _block_v(dk, dv, block_v)
    _replay_gdn_materialize_kernel[(triton.cdiv(dv, block_v), hv, src.shape[0])](
        state, k_ring, delta_ring, g_ring, src, dst, ring_start, n, g_ring.shape[2], dk, dv, hv // hk,
        *_pool_strides(state, k_ring, delta_ring, g_ring), **_fold_sizes(state, g_ring, use_qk_l2norm, block_v),
        num_warps=8,  # sm_90: 122 registers, where 4 warps take 223
    )
