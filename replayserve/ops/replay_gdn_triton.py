"""Triton ReplaySSM kernels for Gated DeltaNet: match ``replay_gdn_step_ref`` and
``replay_gdn_materialize_ref`` of ``replayserve.ops.replay_gdn`` (math: docs/replayssm.md, Gated DeltaNet).

Both kernels run one program per (value head, row) and group of V columns, and build the WY form
of the row's E = history (+ new) ring entries once, in registers: the decays D_ij = exp(G_i - G_j),
the unit lower-triangular system I + A (A_ij = beta_i D_ij k_i.k_j, j < i), its inverse by
forward substitution over the live entries, and W = inv (beta exp(G) k). They then walk the
program's V tiles: U = inv (beta v) per tile.

- The read kernel folds the checkpoint into each new token's query instead of into a state:
  o_i = S0^T q~_i + P_i U with q~_i = exp(G_i) q_i - P_i W and P_ij = D_ij q_i.k_j (j <= i). S0
  is read once and never written; the per-token work on S0 is one (K, BLOCK_V) product per tile,
  as in the baseline step. It always replays from S0 over history + new entries, flush or not
  (equal in exact arithmetic to the reference's replay from the flushed S1), so the fold can run
  after it. It appends the new tokens' (k, v, g, beta) to the rings.
- The fold kernel writes S1 = exp(G_last) S0 + K^T diag(exp(G_last - G_j)) (U - W S0): the flush
  (rows whose `is_flush` is set, entries 0..history-1, in place) and materialization (src -> dst).

The E x E work (about E^2 (K + V) multiply-adds in products and E^3 in the substitution per row
and head, E padded to a power of two) is what a replayed read adds to the baseline's 4 K V per
token; a group of V columns per program repeats it, so the launch takes one group (all of V)
when rows x heads fill the GPU.
Products run in ``PRECISION`` (``tf32x3`` by default: three TF32 products, close to fp32, as the
Mamba2 flush); the launch configuration is not tuned on a GPU yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _entries(ring_ptr, in_ptr, offs_e, offs_d, mask_d, m, n, start, ring_len, s_r_e, s_r_d, s_in_e, s_in_d):
    """(E, D) tile of logical entries: j < m from the ring at (start + j) mod R, m <= j < m + n from
    the input's token j - m (rounded to the ring's dtype, as the ring will hold it), zeros past."""
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    old = tl.load(ring_ptr + phys[:, None] * s_r_e + offs_d[None, :] * s_r_d,
                  mask=(offs_e < m)[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    new_mask = (offs_e >= m) & (offs_e < m + n)
    new = tl.load(in_ptr + (offs_e - m)[:, None] * s_in_e + offs_d[None, :] * s_in_d,
                  mask=new_mask[:, None] & mask_d[None, :], other=0.0)
    return old + new.to(ring_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _scalars(ring_ptr, in_ptr, offs_e, m, n, start, ring_len, s_r_e, s_in_e):
    """(E,) logical entries of a per-token scalar (g or beta), as ``_entries``."""
    phys = start + offs_e
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    old = tl.load(ring_ptr + phys * s_r_e, mask=offs_e < m, other=0.0).to(tl.float32)
    new = tl.load(in_ptr + (offs_e - m) * s_in_e, mask=(offs_e >= m) & (offs_e < m + n), other=0.0)
    return old + new.to(ring_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _wy(k, g, beta, offs_e, live, PRECISION: tl.constexpr):
    """Cumulative log decays G (E,), inv = (I + A)^-1 (E, E) and W = inv (beta exp(G) k) (E, K);
    entries at and past `live` are zero (identity rows of inv)."""
    cum = tl.cumsum(g, 0)
    rows = offs_e[:, None]
    strict = offs_e[None, :] < rows
    decay = tl.where(strict, tl.exp(tl.where(strict, cum[:, None] - cum[None, :], 0.0)), 0.0)
    a = tl.where(strict, beta[:, None] * decay * tl.dot(k, tl.trans(k), input_precision=PRECISION), 0.0)
    # Forward substitution, one row at a time: row i of the inverse is e_i - sum_{j<i} a_ij (row j).
    # A Neumann product (I - A)(I + A^2)(I + A^4)... is exact too, but its powers of A grow like
    # binomials when keys are alike (A_ij near 1) and cancel catastrophically in fp32.
    inv = tl.where(rows == offs_e[None, :], 1.0, 0.0)
    for i in range(1, live):
        a_i = tl.sum(tl.where(rows == i, a, 0.0), axis=0)
        inv = tl.where(rows == i, inv - tl.sum(a_i[:, None] * inv, axis=0)[None, :], inv)
    return cum, inv, tl.dot(inv, (beta * tl.exp(cum))[:, None] * k, input_precision=PRECISION)


@triton.jit
def _normalized(x, L2NORM: tl.constexpr):
    """Rows of x L2-normalized as l2norm_ref (x / sqrt(sum(x^2) + 1e-6)); all-zero rows stay zero."""
    if L2NORM:
        x = x / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]
    return x


@triton.jit
def _replay_gdn_read_kernel(
    state_ptr, k_ring_ptr, v_ring_ptr, g_ring_ptr, beta_ring_ptr, ring_start_ptr, history_ptr, slots_ptr, ntok_ptr,
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    scale, tokens, ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_vr_slot, s_vr_h, s_vr_e, s_vr_v,
    s_gr_slot, s_gr_h, s_gr_e, s_br_slot, s_br_h, s_br_e,
    s_q_b, s_q_t, s_q_h, s_q_k, s_k_b, s_k_t, s_k_h, s_k_k, s_v_b, s_v_t, s_v_h, s_v_v,
    s_g_b, s_g_t, s_g_h, s_be_b, s_be_t, s_be_h, s_o_b, s_o_t, s_o_h, s_o_v,
    L2NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_TILES: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    offs_e, offs_t, offs_k = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_K)
    mask_k = offs_k < dk
    o_row = o_ptr + row * s_o_b + offs_t[:, None] * s_o_t + h * s_o_h
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: nothing read or written but zero outputs
        for vt in tl.static_range(V_TILES):
            offs_v = (pid_v * V_TILES + vt) * BLOCK_V + tl.arange(0, BLOCK_V)
            tl.store(o_row + offs_v[None, :] * s_o_v, tl.zeros([BLOCK_T, BLOCK_V], dtype=tl.float32).to(
                o_ptr.dtype.element_ty), mask=(offs_t < tokens)[:, None] & (offs_v < dv)[None, :])
        return
    n = tl.load(ntok_ptr + row).to(tl.int32)
    m = tl.load(history_ptr + slot).to(tl.int32)
    start = tl.load(ring_start_ptr + slot).to(tl.int32)
    hk = h // heads_per_key
    kr = k_ring_ptr + slot * s_kr_slot + hk * s_kr_h
    vr = v_ring_ptr + slot * s_vr_slot + h * s_vr_h
    gr = g_ring_ptr + slot * s_gr_slot + h * s_gr_h
    br = beta_ring_ptr + slot * s_br_slot + h * s_br_h
    k_in = k_ptr + row * s_k_b + hk * s_k_h
    v_in = v_ptr + row * s_v_b + h * s_v_h
    g_in = g_ptr + row * s_g_b + h * s_g_h
    b_in = beta_ptr + row * s_be_b + h * s_be_h
    k = _normalized(_entries(kr, k_in, offs_e, offs_k, mask_k, m, n, start, ring_len, s_kr_e, s_kr_k, s_k_t, s_k_k),
                    L2NORM)
    g = _scalars(gr, g_in, offs_e, m, n, start, ring_len, s_gr_e, s_g_t)
    beta = _scalars(br, b_in, offs_e, m, n, start, ring_len, s_br_e, s_be_t)
    cum, inv, w = _wy(k, g, beta, offs_e, m + n, PRECISION)

    mask_t = offs_t < n
    q = tl.load(q_ptr + row * s_q_b + offs_t[:, None] * s_q_t + hk * s_q_h + offs_k[None, :] * s_q_k,
                mask=mask_t[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    q = _normalized(q, L2NORM) * scale
    pos = m + offs_t  # each new token's logical entry
    at = offs_e[None, :] <= pos[:, None]
    cum_q = tl.sum(tl.where(offs_e[None, :] == pos[:, None], cum[None, :], 0.0), axis=1)
    p = tl.dot(q, tl.trans(k), input_precision=PRECISION) * tl.where(
        at, tl.exp(tl.where(at, cum_q[:, None] - cum[None, :], 0.0)), 0.0)
    q_eff = tl.exp(cum_q)[:, None] * q - tl.dot(p, w, input_precision=PRECISION)
    # Appends at logical entries m..m+n-1; m + n <= R, so they never land on the history read here.
    phys = start + pos
    phys = tl.where(phys >= ring_len, phys - ring_len, phys)
    for vt in tl.static_range(V_TILES):
        offs_v = (pid_v * V_TILES + vt) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < dv
        v = _entries(vr, v_in, offs_e, offs_v, mask_v, m, n, start, ring_len, s_vr_e, s_vr_v, s_v_t, s_v_v)
        u = tl.dot(inv, beta[:, None] * v, input_precision=PRECISION)
        s0 = tl.load(state_ptr + slot * s_st_slot + h * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v,
                     mask=mask_k[:, None] & mask_v[None, :], other=0.0).to(tl.float32)
        o = tl.dot(q_eff, s0, input_precision=PRECISION) + tl.dot(p, u, input_precision=PRECISION)
        tl.store(o_row + offs_v[None, :] * s_o_v, tl.where(mask_t[:, None], o, 0.0).to(o_ptr.dtype.element_ty),
                 mask=(offs_t < tokens)[:, None] & mask_v[None, :])
        mask_tv = mask_t[:, None] & mask_v[None, :]
        v_new = tl.load(v_in + offs_t[:, None] * s_v_t + offs_v[None, :] * s_v_v, mask=mask_tv)
        tl.store(vr + phys[:, None] * s_vr_e + offs_v[None, :] * s_vr_v, v_new.to(v_ring_ptr.dtype.element_ty),
                 mask=mask_tv)
    if pid_v == 0:
        g_new = tl.load(g_in + offs_t * s_g_t, mask=mask_t)
        b_new = tl.load(b_in + offs_t * s_be_t, mask=mask_t)
        tl.store(gr + phys * s_gr_e, g_new.to(g_ring_ptr.dtype.element_ty), mask=mask_t)
        tl.store(br + phys * s_br_e, b_new.to(beta_ring_ptr.dtype.element_ty), mask=mask_t)
        if h % heads_per_key == 0:  # one value head per key head writes the shared key
            k_new = tl.load(k_in + offs_t[:, None] * s_k_t + offs_k[None, :] * s_k_k,
                            mask=mask_t[:, None] & mask_k[None, :])
            tl.store(kr + phys[:, None] * s_kr_e + offs_k[None, :] * s_kr_k, k_new.to(k_ring_ptr.dtype.element_ty),
                     mask=mask_t[:, None] & mask_k[None, :])


@triton.jit
def _replay_gdn_fold_kernel(
    state_ptr, k_ring_ptr, v_ring_ptr, g_ring_ptr, beta_ring_ptr,
    ring_start_ptr, history_ptr, is_flush_ptr, slots_ptr, src_ptr, dst_ptr, start_ptr, n_ptr,
    ring_len, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v, s_kr_slot, s_kr_h, s_kr_e, s_kr_k, s_vr_slot, s_vr_h, s_vr_e, s_vr_v,
    s_gr_slot, s_gr_h, s_gr_e, s_br_slot, s_br_h, s_br_e,
    FLUSH: tl.constexpr, L2NORM: tl.constexpr, BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, V_TILES: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    if FLUSH:  # the step's flushing rows fold their history into their own checkpoint
        src = tl.load(slots_ptr + row).to(tl.int64)
        if src < 0:
            return
        if tl.load(is_flush_ptr + src) == 0:
            return
        n = tl.load(history_ptr + src).to(tl.int32)
        if n == 0:
            return
        dst = src
        start = tl.load(ring_start_ptr + src).to(tl.int32)
    else:
        src = tl.load(src_ptr + row).to(tl.int64)
        dst = tl.load(dst_ptr + row).to(tl.int64)
        if (src < 0) | (dst < 0):
            return
        n = tl.load(n_ptr + row).to(tl.int32)
        start = tl.load(start_ptr + row).to(tl.int32)
    offs_e, offs_k = tl.arange(0, BLOCK_E), tl.arange(0, BLOCK_K)
    mask_k = offs_k < dk
    hk = h // heads_per_key
    kr = k_ring_ptr + src * s_kr_slot + hk * s_kr_h
    vr = v_ring_ptr + src * s_vr_slot + h * s_vr_h
    gr = g_ring_ptr + src * s_gr_slot + h * s_gr_h
    br = beta_ring_ptr + src * s_br_slot + h * s_br_h
    # Ring entries only (no new tokens): the input pointers are the rings', never dereferenced.
    k = _normalized(_entries(kr, kr, offs_e, offs_k, mask_k, n, 0, start, ring_len, s_kr_e, s_kr_k, s_kr_e, s_kr_k),
                    L2NORM)
    g = _scalars(gr, gr, offs_e, n, 0, start, ring_len, s_gr_e, s_gr_e)
    beta = _scalars(br, br, offs_e, n, 0, start, ring_len, s_br_e, s_br_e)
    cum, inv, w = _wy(k, g, beta, offs_e, n, PRECISION)
    last = tl.sum(tl.where(offs_e == n - 1, cum, 0.0))
    k_to_end = k * tl.where(offs_e < n, tl.exp(last - cum), 0.0)[:, None]
    for vt in tl.static_range(V_TILES):
        offs_v = (pid_v * V_TILES + vt) * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_v = offs_v < dv
        v = _entries(vr, vr, offs_e, offs_v, mask_v, n, 0, start, ring_len, s_vr_e, s_vr_v, s_vr_e, s_vr_v)
        tile = h * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
        mask_kv = mask_k[:, None] & mask_v[None, :]
        s0 = tl.load(state_ptr + src * s_st_slot + tile, mask=mask_kv, other=0.0).to(tl.float32)
        delta = tl.dot(inv, beta[:, None] * v, input_precision=PRECISION) - tl.dot(w, s0, input_precision=PRECISION)
        s1 = tl.exp(last) * s0 + tl.dot(tl.trans(k_to_end), delta, input_precision=PRECISION)
        tl.store(state_ptr + dst * s_st_slot + tile, s1.to(state_ptr.dtype.element_ty), mask=mask_kv)


# The products' input precision: three TF32 products per fp32 product (the interpreter computes fp32).
PRECISION = "tf32x3"


def _blocks(ring_len: int, dk: int, dv: int, programs: int, v_groups: int | None) -> tuple[int, dict]:
    """(groups of V columns, block sizes). tl.dot needs every dimension >= 16. One group (all of V per
    program, the E x E work done once) unless rows x heads (`programs`) are too few to fill a GPU."""
    block_e, block_k = max(16, triton.next_power_of_2(ring_len)), max(16, triton.next_power_of_2(dk))
    block_v = max(16, min(triton.next_power_of_2(dv), 4096 // block_k))
    tiles = triton.cdiv(dv, block_v)
    if v_groups is None:
        v_groups = 1 if programs >= 1024 else tiles
    if tiles % v_groups:
        raise ValueError(f"v_groups={v_groups} must divide the {tiles} V tiles of {block_v} columns")
    return v_groups, {"BLOCK_E": block_e, "BLOCK_K": block_k,
                      "BLOCK_V": block_v, "V_TILES": tiles // v_groups, "PRECISION": PRECISION}


def _pool_strides(state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor) -> list[int]:
    return [*state.stride(), *k_ring.stride(), *v_ring.stride(), *g_ring.stride(), *beta_ring.stride()]


def replay_gdn_step_triton(
    state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False, v_groups: int | None = None,
) -> Tensor:
    """``replay_gdn_step_ref`` on GPU (or the Triton interpreter): the read kernel, then the flush.

    Shapes as the reference: the pool (``replay_gdn`` module docstring), cursors (S,), slots (rows,)
    int64 (-1 or a pad slot for padding), num_tokens (rows,) int, q, k (rows, T, Hk, K),
    v (rows, T, Hv, V), g, beta (rows, T, Hv). Returns o (rows, T, Hv, V) in v's dtype. The pool's
    shapes are checked by the entry point (``replay_gdn.replay_gdn_step``). v_groups: programs per
    (row, head), each over V / v_groups columns (None: chosen by the batch).
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
    v_groups, blocks = _blocks(ring_len, dk, dv, rows * hv, v_groups)
    grid = (v_groups, hv, rows)
    pool = _pool_strides(state, k_ring, v_ring, g_ring, beta_ring)
    _replay_gdn_read_kernel[grid](
        state, k_ring, v_ring, g_ring, beta_ring, ring_start, history, slots, num_tokens, q, k, v, g, beta, o,
        dk ** -0.5 if scale is None else scale, tokens, ring_len, dk, dv, hv // hk, *pool,
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        L2NORM=use_qk_l2norm, BLOCK_T=max(16, triton.next_power_of_2(tokens)), num_warps=4, **blocks,
    )
    _replay_gdn_fold_kernel[grid](
        state, k_ring, v_ring, g_ring, beta_ring, ring_start, history, is_flush, slots, None, None, None, None,
        ring_len, dk, dv, hv // hk, *pool, FLUSH=True, L2NORM=use_qk_l2norm, num_warps=4, **blocks,
    )
    return o


def replay_gdn_materialize_triton(state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
                                  src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor,
                                  use_qk_l2norm: bool = False, v_groups: int | None = None) -> None:
    """``replay_gdn_materialize_ref`` on GPU: src, dst (rows,) int64, ring_start, n (rows,) int32;
    v_groups as in ``replay_gdn_step_triton``.

    Each program reads its source tile before writing its destination tile, so a row may fold in
    place (src == dst); a row's dst must not be another row's src.
    """
    (hv, dk, dv), hk, ring_len = state.shape[1:], k_ring.shape[1], g_ring.shape[2]
    if src.dim() != 1 or any(t.shape != src.shape for t in (dst, ring_start, n)):
        raise ValueError(f"src, dst, ring_start, n must all be (rows,), got {tuple(src.shape)}, {tuple(dst.shape)}, "
                         f"{tuple(ring_start.shape)}, {tuple(n.shape)}")
    if src.shape[0] == 0:
        return
    v_groups, blocks = _blocks(ring_len, dk, dv, src.shape[0] * hv, v_groups)
    _replay_gdn_fold_kernel[(v_groups, hv, src.shape[0])](
        state, k_ring, v_ring, g_ring, beta_ring, None, None, None, None, src, dst, ring_start, n,
        ring_len, dk, dv, hv // hk, *_pool_strides(state, k_ring, v_ring, g_ring, beta_ring),
        FLUSH=False, L2NORM=use_qk_l2norm, num_warps=4, **blocks,
    )
