"""Triton ReplaySSM (Mode B) kernels: match ``replay_step_ref`` and ``replay_materialize_ref`` in
``replayserve.ops.replay_ssm`` (the cursor kernels, prepare and commit, are in
``replay_cursors_triton`` and re-exported here).

Contract: ``docs/replayssm-contract.md``; algorithm: ``docs/replayssm.md`` (Cursors, The flush).

A step is two launches. ``_replay_scores_kernel``, one program per (group, row), appends the
window's B to the ring and writes the fp32 products B_j . C_t for the row's history entries and
window tokens into a small scratch (rows, G, T, lanes) that the group's heads share. Then
``_replay_step_kernel``, one program per (P-block, head, row), reads its (BLOCK_P, N) checkpoint
tile, the history, logical entries ``0..m-1`` (m <= W) at physical ``ring_start + j`` (wrapped
by one conditional subtraction), and the window, this step's ``n`` tokens, which it appends to
the x/delta rings. The window is read out as stored (rounded to the ring dtypes), so outputs use
exactly what later replays see. History reads and appends never share a physical slot
(``m + n <= R``), so the programs of one row need no ordering.

Every row, flush or not, is read out from S0 over history + window, which equals the contract's
readout(S1, window) in exact arithmetic. The tile is reduced against each token's C right after
the ring loads are issued, so its loads overlap the cursor -> ring chain and its registers are
free afterwards. The flush folds each flushing row's history in tile form,
S1 = e^{A G_m} S0 + (x_h w)^T B_h. Decode steps (T <= ``SEPARATE_FLUSH_TOKENS``) leave it to
``replay_flush_triton``, a persistent kernel launched after this one that spends programs only
on the flushing rows (about 1/W of them); the step kernel then carries no fold and keeps its
register cap. Verify steps (T > 1) fold inside the step kernel (``FUSED_FLUSH``: fp32 products,
``input_precision="ieee"``), in column chunks of the tile reloaded from cache; both run the flush
kernel's ``fold_history_tile``.
Materialization folds token by token (``_fold``), like the baseline update. Readouts use explicit
fp32 reductions: at decode sizes (T <= 4) 16-wide dot tiles would mostly multiply padding.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.replay_cursors_triton import flag_bytes, replay_commit_triton, replay_prepare_triton
from replayserve.ops.replay_flush_triton import fold_history_tile, replay_flush_triton
from replayserve.ops.time_step_triton import process_dt

__all__ = ["replay_commit_triton", "replay_flush_triton", "replay_materialize_triton", "replay_prepare_triton",
           "replay_step_triton"]


@triton.jit
def _fold(s, xr_row, dr_row, br_row, start, count, R, a, offs_p, offs_n, mask_p, mask_n,
          s_xr_r, s_xr_p, s_dr_r, s_br_r, s_br_n):
    """fold(S, entries 0..count-1 from physical ``start``) as the recurrence S = e^{A d} S + d x b^T.

    s: (BLOCK_P, BLOCK_N) fp32. Materialization's fold, token by token like the baseline update
    (the step kernel's flush uses the tile form instead). A loop, not unrolled, so registers stay
    those of one entry; each iteration loads the next entry before it folds this one.
    """
    p = start
    d = tl.load(dr_row + p * s_dr_r, mask=count > 0, other=0.0).to(tl.float32)
    xj = tl.load(xr_row + p * s_xr_r + offs_p * s_xr_p, mask=mask_p & (count > 0), other=0.0).to(tl.float32)
    bj = tl.load(br_row + p * s_br_r + offs_n * s_br_n, mask=mask_n & (count > 0), other=0.0).to(tl.float32)
    for i in range(count):
        p = tl.where(p + 1 >= R, p + 1 - R, p + 1)
        more = i + 1 < count
        d_next = tl.load(dr_row + p * s_dr_r, mask=more, other=0.0).to(tl.float32)
        x_next = tl.load(xr_row + p * s_xr_r + offs_p * s_xr_p, mask=mask_p & more, other=0.0).to(tl.float32)
        b_next = tl.load(br_row + p * s_br_r + offs_n * s_br_n, mask=mask_n & more, other=0.0).to(tl.float32)
        s = s * tl.exp(a * d) + (d * xj)[:, None] * bj[None, :]
        d, xj, bj = d_next, x_next, b_next
    return s


@triton.jit
def _replay_scores_kernel(
    br_ptr, rs_ptr, hist_ptr, slots_ptr, ntok_ptr, B_ptr, C_ptr, cb_ptr,
    R, dstate, ngroups,
    s_br_slot, s_br_g, s_br_r, s_br_n,
    s_B_b, s_B_t, s_B_g, s_B_n,
    s_C_b, s_C_t, s_C_g, s_C_n,
    T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """Per (group, row): cb[row, g, t, lane] = B . C_t in fp32, shared by the group's heads, over
    BLOCK_W history lanes (logical entries 0..m-1, zero beyond) then BLOCK_T window lanes. Also
    appends the window's B to the ring (rounded to its dtype)."""
    g = tl.program_id(0)
    row = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    n = tl.load(ntok_ptr + row)
    m = tl.load(hist_ptr + slot)
    start = tl.load(rs_ptr + slot)
    offs_n = tl.arange(0, BLOCK_N)
    mln = (offs_n < dstate)[None, :]
    br_row = br_ptr + slot * s_br_slot + g * s_br_g
    jh = tl.arange(0, BLOCK_W)
    ph = start + jh
    ph = tl.where(ph >= R, ph - R, ph)
    bh = tl.load(br_row + ph[:, None] * s_br_r + offs_n[None, :] * s_br_n, mask=(jh < m)[:, None] & mln,
                 other=0.0).to(tl.float32)
    jw = tl.arange(0, BLOCK_T)
    win = jw < n
    pw = start + m + jw
    pw = tl.where(pw >= R, pw - R, pw)
    bw = tl.load(B_ptr + row * s_B_b + g * s_B_g + jw[:, None] * s_B_t + offs_n[None, :] * s_B_n,
                 mask=win[:, None] & mln, other=0.0).to(br_ptr.dtype.element_ty)
    tl.store(br_row + pw[:, None] * s_br_r + offs_n[None, :] * s_br_n, bw, mask=win[:, None] & mln)
    bw = bw.to(tl.float32)
    cb_row = cb_ptr + (row * ngroups + g) * (T * (BLOCK_W + BLOCK_T))
    for t in tl.static_range(T):
        c = tl.load(C_ptr + row * s_C_b + t * s_C_t + g * s_C_g + offs_n * s_C_n, mask=(offs_n < dstate) & (t < n),
                    other=0.0).to(tl.float32)
        tl.store(cb_row + t * (BLOCK_W + BLOCK_T) + jh, tl.sum(bh * c[None, :], axis=1))
        tl.store(cb_row + t * (BLOCK_W + BLOCK_T) + BLOCK_W + jw, tl.sum(bw * c[None, :], axis=1))


@triton.jit
def _replay_step_kernel(
    state_ptr, xr_ptr, dr_ptr, br_ptr, rs_ptr, hist_ptr, flush_ptr, slots_ptr, ntok_ptr,
    x_ptr, dt_ptr, A_ptr, C_ptr, cb_ptr, D_ptr, dt_bias_ptr, y_ptr,
    dt_min, dt_max, R, dim, dstate, heads_per_group, ngroups,
    s_st_slot, s_st_h, s_st_p, s_st_n,
    s_xr_slot, s_xr_h, s_xr_r, s_xr_p,
    s_dr_slot, s_dr_h, s_dr_r,
    s_br_slot, s_br_g, s_br_r, s_br_n,
    s_x_b, s_x_t, s_x_h, s_x_p,
    s_dt_b, s_dt_t, s_dt_h,
    s_C_b, s_C_t, s_C_g, s_C_n,
    s_y_b, s_y_t, s_y_h, s_y_p,
    T: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_T: tl.constexpr,
    FOLD_N: tl.constexpr, FUSED_FLUSH: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < dim
    mask_n = offs_n < dstate
    y_ptrs = y_ptr + row * s_y_b + h * s_y_h + offs_p * s_y_p
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:  # padded row: touches nothing, outputs zeros
        for t in tl.static_range(T):
            tl.store(y_ptrs + t * s_y_t, tl.zeros([BLOCK_P], dtype=tl.float32).to(y_ptr.dtype.element_ty), mask=mask_p)
        return
    # The checkpoint tile is the only large read: issue it first, ahead of the cursor chain.
    st_ptrs = state_ptr + slot * s_st_slot + h * s_st_h + offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n
    mask_pn = mask_p[:, None] & mask_n[None, :]
    n = tl.load(ntok_ptr + row)
    m = tl.load(hist_ptr + slot)
    start = tl.load(rs_ptr + slot)
    g = h // heads_per_group
    s = tl.load(st_ptrs, mask=mask_pn, other=0.0).to(tl.float32)
    a = tl.load(A_ptr + h).to(tl.float32)
    xr_row = xr_ptr + slot * s_xr_slot + h * s_xr_h
    dr_row = dr_ptr + slot * s_dr_slot + h * s_dr_h
    x_row = x_ptr + row * s_x_b + h * s_x_h
    mlp = mask_p[None, :]

    # History: logical entries 0..m-1 (m <= W) from the rings, in logical order.
    jh = tl.arange(0, BLOCK_W)
    hist = jh < m
    ph = start + jh
    ph = tl.where(ph >= R, ph - R, ph)
    xh = tl.load(xr_row + ph[:, None] * s_xr_r + offs_p[None, :] * s_xr_p, mask=hist[:, None] & mlp,
                 other=0.0)
    dh = tl.load(dr_row + ph * s_dr_r, mask=hist, other=0.0).to(tl.float32)
    # Reduce the tile against every token's C now, after the ring loads are issued and before
    # anything waits on them: the tile's loads then overlap the cursor -> ring chain, and its
    # registers are free for the rest.
    jw = tl.arange(0, BLOCK_T)
    state_out = tl.zeros((BLOCK_T, BLOCK_P), dtype=tl.float32)
    for t in tl.static_range(T):
        c = tl.load(C_ptr + row * s_C_b + t * s_C_t + g * s_C_g + offs_n * s_C_n, mask=mask_n, other=0.0)
        state_out = tl.where(jw[:, None] == t, tl.sum(s * c.to(tl.float32)[None, :], axis=1)[None, :], state_out)
    g_m = tl.sum(dh, axis=0)  # Gamma over the whole history
    to_end = g_m - tl.cumsum(dh, axis=0)  # Gamma after entry j, to the window start

    # Window: this step's tokens i < n (logical entries m..m+n-1), rounded to the ring dtypes.
    win = jw < n
    bias = 0.0
    if HAS_DT_BIAS:
        bias = tl.load(dt_bias_ptr + h).to(tl.float32)
    dw = process_dt(tl.load(dt_ptr + row * s_dt_b + h * s_dt_h + jw * s_dt_t, mask=win, other=0.0).to(tl.float32),
                    bias, dt_min, dt_max, True)
    dw = tl.where(win, dw, 0.0).to(dr_ptr.dtype.element_ty)
    xw = tl.load(x_row + jw[:, None] * s_x_t + offs_p[None, :] * s_x_p, mask=win[:, None] & mlp,
                 other=0.0).to(xr_ptr.dtype.element_ty)
    gam_w = tl.cumsum(dw.to(tl.float32), axis=0)  # Gamma within the window, from its first entry

    # Readout of token t (entry m + t) from S0 over history + window, for flush rows too: it
    # equals readout(S1, window) in exact arithmetic, and S0 is already in registers.
    d_skip = 0.0
    if HAS_D:
        d_skip = tl.load(D_ptr + h).to(tl.float32)
    cb_row = cb_ptr + (row * ngroups + g) * (T * (BLOCK_W + BLOCK_T))
    for t in tl.static_range(T):
        g_t = tl.sum(tl.where(jw == t, gam_w, 0.0), axis=0)
        wh = tl.where(hist, tl.exp(tl.where(hist, a * (to_end + g_t), float("-inf"))) * dh, 0.0)
        wh = wh * tl.load(cb_row + t * (BLOCK_W + BLOCK_T) + jh)
        used_w = win & (jw <= t)
        ww = tl.where(used_w, tl.exp(tl.where(used_w, a * (g_t - gam_w), float("-inf"))) * dw.to(tl.float32), 0.0)
        ww = ww * tl.load(cb_row + t * (BLOCK_W + BLOCK_T) + BLOCK_W + jw)
        x_t = tl.load(x_row + t * s_x_t + offs_p * s_x_p, mask=mask_p & (t < n), other=0.0)
        x_t = x_t.to(xr_ptr.dtype.element_ty).to(tl.float32)
        s_c = tl.sum(tl.where(jw[:, None] == t, state_out, 0.0), axis=0)
        y = (tl.exp(a * (g_m + g_t)) * s_c + tl.sum(xh.to(tl.float32) * wh[:, None], axis=0)
             + tl.sum(xw.to(tl.float32) * ww[:, None], axis=0) + d_skip * x_t)
        y = tl.where(t < n, y, 0.0)
        tl.store(y_ptrs + t * s_y_t, y.to(y_ptr.dtype.element_ty), mask=mask_p)

    # Append the window's x (every P-block) and delta (P-block 0); the scores kernel appends B.
    pw = start + m + jw
    pw = tl.where(pw >= R, pw - R, pw)
    tl.store(xr_row + pw[:, None] * s_xr_r + offs_p[None, :] * s_xr_p, xw, mask=win[:, None] & mlp)
    tl.store(dr_row + pw * s_dr_r, dw, mask=win & (pid_p == 0))
    if FUSED_FLUSH and (tl.load(flush_ptr + slot) != 0) & (m > 0):  # S1 = fold(S0, history): the new checkpoint
        # Tile form, in FOLD_N-column chunks of the tile reloaded from cache: one latency per chunk,
        # not one per entry; fp32 products.
        br_row = br_ptr + slot * s_br_slot + g * s_br_g
        st_row = state_ptr + slot * s_st_slot + h * s_st_h + offs_p[:, None] * s_st_p
        fold_history_tile(st_row, br_row, xh, dh, to_end, g_m, a, hist, ph, mask_p, dstate, s_st_n, s_br_r, s_br_n,
                          BLOCK_N, FOLD_N, None, "ieee")


@triton.jit
def _replay_materialize_kernel(
    state_ptr, xr_ptr, dr_ptr, br_ptr, A_ptr, src_ptr, dst_ptr, rs_ptr, nrep_ptr,
    R, dim, dstate, heads_per_group,
    s_st_slot, s_st_h, s_st_p, s_st_n,
    s_xr_slot, s_xr_h, s_xr_r, s_xr_p,
    s_dr_slot, s_dr_h, s_dr_r,
    s_br_slot, s_br_g, s_br_r, s_br_n,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_p = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    src = tl.load(src_ptr + row).to(tl.int64)
    dst = tl.load(dst_ptr + row).to(tl.int64)
    if (src < 0) | (dst < 0):
        return
    nrep = tl.load(nrep_ptr + row)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < dim
    mask_n = offs_n < dstate
    mask_pn = mask_p[:, None] & mask_n[None, :]
    tile = offs_p[:, None] * s_st_p + offs_n[None, :] * s_st_n
    s = tl.load(state_ptr + src * s_st_slot + h * s_st_h + tile, mask=mask_pn, other=0.0)
    dst_ptrs = state_ptr + dst * s_st_slot + h * s_st_h + tile
    if nrep > 0:
        g = h // heads_per_group
        s = _fold(s.to(tl.float32), xr_ptr + src * s_xr_slot + h * s_xr_h, dr_ptr + src * s_dr_slot + h * s_dr_h,
                  br_ptr + src * s_br_slot + g * s_br_g, tl.load(rs_ptr + row), nrep, R,
                  tl.load(A_ptr + h).to(tl.float32), offs_p, offs_n, mask_p, mask_n,
                  s_xr_r, s_xr_p, s_dr_r, s_br_r, s_br_n)
        tl.store(dst_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_pn)
    else:  # n == 0: the loaded tile, untouched, is an exact copy
        tl.store(dst_ptrs, s, mask=mask_pn)


def _step_config(dim: int, dstate: int, ring_len: int, tokens: int) -> dict[str, int]:
    """Launch options of the step and materialize kernels: BLOCK_P, num_warps, and a register cap.

    Measured on an H200 (P=64, N=128, W=16, T=1, batch 128, 2026-12-03): BLOCK_P=16 with one warp
    was the best of BLOCK_P 16..64 x 1..8 warps; the step is bound by loads in flight per SM, so
    registers per program set its speed. The tile-form flush would take 118 registers; capped at
    96 it compiles without spills and ran 3-5% faster than the 95-register token-by-token fold
    (bs 128/256/512: 167/318/627 us vs 173/336/654). Verify (T > 1) keeps more per-token values
    live; it keeps 32 x 4 (not yet tuned). BLOCK_P >= 16: the flush product needs M >= 16.
    """
    if tokens == 1:
        return {"BLOCK_P": 16, "num_warps": 1, "maxnreg": 96}
    return {"BLOCK_P": max(16, min(triton.next_power_of_2(dim), 32)), "num_warps": 4}


FOLD_N = 16  # columns per chunk of the flush product (16 x BLOCK_W x 16): fewer registers than 32
# Steps of at most this many tokens per row flush in ``replay_flush_triton`` after the step kernel;
# verify steps fold inside it.
SEPARATE_FLUSH_TOKENS = 1


def _lanes(count: int) -> int:
    """Tile length for up to ``count`` entries or tokens (>= 2, so no axis has size one)."""
    return max(2, triton.next_power_of_2(count))


def _check_rings(state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor) -> tuple[int, int, int, int, int]:
    slots, nheads, dim, dstate = state.shape
    ngroups, ring_len = B_ring.shape[1], B_ring.shape[2]
    if x_ring.shape != (slots, nheads, ring_len, dim) or dt_ring.shape != (slots, nheads, ring_len):
        raise ValueError(f"rings x {tuple(x_ring.shape)}, dt {tuple(dt_ring.shape)} do not match state "
                         f"{tuple(state.shape)} and B ring {tuple(B_ring.shape)}")
    if B_ring.shape != (slots, ngroups, ring_len, dstate) or nheads % ngroups != 0:
        raise ValueError(f"B ring {tuple(B_ring.shape)} must be (S, G, R, N) with H={nheads} a multiple of G")
    return nheads, dim, dstate, ngroups, ring_len


def replay_step_triton(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> Tensor:
    """One decode (T = 1) or verify (T > 1) step over checkpoint + rings; cursors are read only.

    Arguments:
        state: (S, H, P, N) checkpoints, state dtype; written only for flush rows with history > 0.
        x_ring: (S, H, R, P) activation dtype; dt_ring: (S, H, R) processed delta, state dtype;
            B_ring: (S, G, R, N) activation dtype. Entries m..m+n-1 of each real row are appended.
        ring_start, history: (S,) int32; is_flush: (S,) bool (from the prepare).
        slots: (rows,) int64, -1 = padded row; num_tokens: (rows,) int32 in [1, T].
        x: (rows, T, H, P); dt: (rows, T, H) raw; B, C: (rows, T, G, N): padded to T per row.
        A: (H,) fp32; D, dt_bias: (H,) or None; dt_limit: (min, max) clamp of the processed delta.
        The window is read out as stored in the rings (rounded to their dtypes), like the reference.

    Returns:
        y: (rows, T, H, P) in x.dtype (fp32 math); zeros for padded rows and tokens >= n.
    """
    nheads, dim, dstate, ngroups, ring_len = _check_rings(state, x_ring, dt_ring, B_ring)
    rows, tokens = x.shape[0], x.shape[1]
    if x.shape != (rows, tokens, nheads, dim) or dt.shape != (rows, tokens, nheads):
        raise ValueError(f"x {tuple(x.shape)} / dt {tuple(dt.shape)} must be (rows, T, {nheads}, {dim}) / "
                         f"(rows, T, {nheads})")
    if B.shape != (rows, tokens, ngroups, dstate) or C.shape != B.shape:
        raise ValueError(f"B {tuple(B.shape)} and C {tuple(C.shape)} must be ({rows}, {tokens}, {ngroups}, {dstate})")
    if not 1 <= tokens <= ring_len - tokens:
        raise ValueError(f"T={tokens} must satisfy 1 <= T <= W = R - T with R={ring_len}")
    y = torch.empty_like(x)
    if rows == 0:
        return y
    # >= 16 lanes: the flush product's K and N dimensions.
    block_w, block_t = max(16, _lanes(ring_len - tokens)), _lanes(tokens)
    block_n = max(16, triton.next_power_of_2(dstate))
    scores = torch.empty((rows, ngroups, tokens, block_w + block_t), dtype=torch.float32, device=x.device)
    _replay_scores_kernel[(ngroups, rows)](
        B_ring, ring_start, history, slots, num_tokens, B, C, scores,
        ring_len, dstate, ngroups, *B_ring.stride(), *B.stride(), *C.stride(),
        T=tokens, BLOCK_N=block_n, BLOCK_W=block_w, BLOCK_T=block_t,
    )
    launch = _step_config(dim, dstate, ring_len, tokens)
    apart = tokens <= SEPARATE_FLUSH_TOKENS
    _replay_step_kernel[(triton.cdiv(dim, launch["BLOCK_P"]), nheads, rows)](
        state, x_ring, dt_ring, B_ring, ring_start, history, flag_bytes(is_flush), slots, num_tokens,
        x, dt, A, C, scores, D, dt_bias, y,
        float(dt_limit[0]), float(dt_limit[1]), ring_len, dim, dstate, nheads // ngroups, ngroups,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *B_ring.stride(),
        *x.stride(), *dt.stride(), *C.stride(), *y.stride(),
        T=tokens, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        BLOCK_N=block_n, BLOCK_W=block_w, BLOCK_T=block_t, FOLD_N=min(FOLD_N, block_n), FUSED_FLUSH=not apart,
        **launch,
    )
    if apart:
        replay_flush_triton(state, x_ring, dt_ring, B_ring, ring_start, history, is_flush, slots, A)
    return y


def replay_materialize_triton(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A: Tensor,
    src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor,
) -> None:
    """``state[dst] = fold(state[src], entries 0..n-1 of src's ring from ring_start)`` per row.

    Arguments:
        state: (S, H, P, N); only rows ``dst`` are written. Rings as in ``replay_step_triton``,
            read only.
        A: (H,) fp32.
        src, dst: (rows,) int64 slots; a row with a negative slot is skipped. Rows run in parallel:
            dst slots must be distinct and no row's dst may be another row's src (src == dst within
            one row is fine: each program reads its tile before writing it).
        ring_start: (rows,) int32 physical index of src's logical entry 0.
        n: (rows,) int32 entries to fold, 0 <= n <= history(src); n == 0 is an exact copy.
    """
    nheads, dim, dstate, ngroups, ring_len = _check_rings(state, x_ring, dt_ring, B_ring)
    rows = src.shape[0]
    if rows == 0:
        return
    launch = _step_config(dim, dstate, ring_len, 1)
    grid = (triton.cdiv(dim, launch["BLOCK_P"]), nheads, rows)
    _replay_materialize_kernel[grid](
        state, x_ring, dt_ring, B_ring, A, src, dst, ring_start, n,
        ring_len, dim, dstate, nheads // ngroups,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *B_ring.stride(),
        BLOCK_N=triton.next_power_of_2(dstate), **launch,
    )
