"""The ReplaySSM flush as its own kernel: the checkpoint of every flushing row folds its history.

For a real row whose slot has ``is_flush`` set and ``history = m > 0``:
``state[slot] = fold(state[slot], logical entries 0..m-1 of the slot's rings)``, which is
``replay_materialize_ref`` with ``src = dst = slot`` and ``n = m``. It runs after the step kernel of
the same layer, which read the old checkpoint for its readout and appended the window behind the
history (``m + n <= R``), so the entries folded here are untouched. Cursors are read only; the
commit moves them.

Why apart from the step kernel: at T = 1 only about 1/W of the rows flush on a step, and a fold
inside the step kernel holds registers in every program and folds its tile in small chunks, one
cache round trip each (at W = 32 a flushing program took 8x a plain one on the H100). Here a
fixed grid of persistent programs, sized to fill the GPU, first lists the flushing rows (every
program scans the step's rows: a few hundred flags), then takes (row, head, P-block) items in
turn; the grid is fixed, so a CUDA graph captures it, and no program is spent on a row that does
not flush. Each item folds in tile form, ``S1 = e^{A G_m} S0 + (x_h w)^T B_h`` with
``w_j = e^{A (G_m - G_j)} d_j``, over column chunks whose loads the loop pipelines.

The products use ``input_precision="tf32x3"``: three TF32 products per fp32 product (hi*hi +
hi*lo + lo*hi) keep them good to about 2^-22 relative, near fp32, on the tensor cores, and the
kernel needs fewer registers than with the FMA ("ieee") dot (at W = 32: 96-123 against 187-209),
so more programs stay resident. On CPU the interpreter computes them in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from replayserve.ops.replay_cursors_triton import flag_bytes


@triton.jit
def flushing_rows(slots_ptr, flush_ptr, hist_ptr, rows, BLOCK_ROWS: tl.constexpr):
    """The step's flushing rows (flag set and a history to fold), in row order, for persistent flush
    programs: (slots, padding rows at 0; the flushing mask; the running count, so that the f-th
    flushing row is where it reaches f + 1; how many flush). Shared by the Mamba2 and GDN flushes."""
    offs_r = tl.arange(0, BLOCK_ROWS)
    slot_r = tl.load(slots_ptr + offs_r, mask=offs_r < rows, other=-1).to(tl.int64)
    real = slot_r >= 0
    safe = tl.where(real, slot_r, 0)
    flush = real & (tl.load(flush_ptr + safe, mask=real, other=0) != 0)
    flush = flush & (tl.load(hist_ptr + safe, mask=flush, other=0) > 0)
    rank = tl.cumsum(flush.to(tl.int32), axis=0)
    return safe, flush, rank, tl.sum(flush.to(tl.int32), axis=0)


@triton.jit
def fold_history_tile(st_row, br_row, xh, dh, to_end, g_m, a, hist, ph, mask_p, dstate, s_st_n, s_br_r, s_br_n,
                      BLOCK_N: tl.constexpr, FOLD_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr):
    """The flush of one (BLOCK_P, N) checkpoint tile, IN PLACE, in tile form (module docstring):
    ``S1 = e^{A G_m} S0 + (x_h w)^T B_h`` with ``w_j = e^{A (G_m - G_j)} d_j``, in FOLD_N-column
    chunks of the tile. This kernel's and the step kernel's fused flush (verify steps) both run it.

    st_row: (BLOCK_P, 1) pointers to the tile's rows; br_row: the slot's B ring of the head's group.
    xh: (BLOCK_W, BLOCK_P) the history's x; dh, to_end: (BLOCK_W,) fp32 its deltas and G_m - G_j;
    all zero past the history, whose entries `hist` marks and `ph` places in the rings. g_m: G_m;
    a: the head's A (fp32). STAGES: the chunk loop's pipelining (None: the compiler's choice);
    PRECISION: the products' input_precision.
    """
    w = tl.where(hist, tl.exp(tl.where(hist, a * to_end, float("-inf"))) * dh, 0.0)
    xw_t = tl.trans(xh.to(tl.float32) * w[:, None])  # (BLOCK_P, BLOCK_W)
    decay = tl.exp(a * g_m)
    for n0 in tl.range(0, BLOCK_N, FOLD_N, num_stages=STAGES):
        offs_c = n0 + tl.arange(0, FOLD_N)
        mask_c = offs_c < dstate
        bh = tl.load(br_row + ph[:, None] * s_br_r + offs_c[None, :] * s_br_n, mask=hist[:, None] & mask_c[None, :],
                     other=0.0).to(tl.float32)
        c_ptrs = st_row + offs_c[None, :] * s_st_n
        mask_pc = mask_p[:, None] & mask_c[None, :]
        piece = tl.load(c_ptrs, mask=mask_pc, other=0.0).to(tl.float32)
        piece = decay * piece + tl.dot(xw_t, bh, input_precision=PRECISION)
        tl.store(c_ptrs, piece.to(c_ptrs.dtype.element_ty), mask=mask_pc)


# `rows` changes every step; BLOCK_ROWS follows it, and not specialising on its value (== 1,
# divisible by 16) lets an eager step of any row count reuse the variant of its graph bucket.
@triton.jit(do_not_specialize=["rows"])
def _replay_flush_kernel(
    state_ptr, xr_ptr, dr_ptr, br_ptr, rs_ptr, hist_ptr, flush_ptr, slots_ptr, A_ptr,
    rows, R, dim, dstate, nheads, heads_per_group,
    s_st_slot, s_st_h, s_st_p, s_st_n,
    s_xr_slot, s_xr_h, s_xr_r, s_xr_p,
    s_dr_slot, s_dr_h, s_dr_r,
    s_br_slot, s_br_g, s_br_r, s_br_n,
    BLOCK_ROWS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr,
    FOLD_N: tl.constexpr, STAGES: tl.constexpr, PRECISION: tl.constexpr,
):
    safe, flush, rank, count = flushing_rows(slots_ptr, flush_ptr, hist_ptr, rows, BLOCK_ROWS)
    pblocks = tl.cdiv(dim, BLOCK_P)
    per_row = nheads * pblocks
    jh = tl.arange(0, BLOCK_W)
    for item in range(tl.program_id(0), count * per_row, tl.num_programs(0)):
        f = item // per_row
        h = (item % per_row) // pblocks
        offs_p = (item % pblocks) * BLOCK_P + tl.arange(0, BLOCK_P)
        mask_p = offs_p < dim
        slot = tl.sum(tl.where(flush & (rank == f + 1), safe, 0), axis=0)
        m = tl.load(hist_ptr + slot)
        start = tl.load(rs_ptr + slot)
        a = tl.load(A_ptr + h).to(tl.float32)
        hist = jh < m
        ph = start + jh
        ph = tl.where(ph >= R, ph - R, ph)
        xh = tl.load(xr_ptr + slot * s_xr_slot + h * s_xr_h + ph[:, None] * s_xr_r + offs_p[None, :] * s_xr_p,
                     mask=hist[:, None] & mask_p[None, :], other=0.0).to(tl.float32)
        dh = tl.load(dr_ptr + slot * s_dr_slot + h * s_dr_h + ph * s_dr_r, mask=hist, other=0.0).to(tl.float32)
        g_m = tl.sum(dh, axis=0)
        br_row = br_ptr + slot * s_br_slot + (h // heads_per_group) * s_br_g
        st_row = state_ptr + slot * s_st_slot + h * s_st_h + offs_p[:, None] * s_st_p
        fold_history_tile(st_row, br_row, xh, dh, g_m - tl.cumsum(dh, axis=0), g_m, a, hist, ph, mask_p, dstate,
                          s_st_n, s_br_r, s_br_n, BLOCK_N, FOLD_N, STAGES, PRECISION)


# Launch options; programs per SM times the SM count is the grid. The fastest of ten candidates on
# the H100 (docs/perf-log/2026-12-06-replayssm-window-and-flush.md): an all-flush step at 256 rows
# (W = 32) took 1349 us against 3276 us for the fold fused into the step kernel.
FLUSH_CONFIG = {"BLOCK_P": 64, "FOLD_N": 32, "num_warps": 4, "STAGES": 3, "programs_per_sm": 4, "PRECISION": "tf32x3"}


def _programs(device: torch.device, per_sm: int) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one by one: a few exercise the item loop
    return torch.cuda.get_device_properties(device).multi_processor_count * per_sm


def replay_flush_triton(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, A: Tensor,
) -> None:
    """Folds every flushing row's history into its checkpoint (module docstring); IN PLACE.

    Arguments:
        state: (S, H, P, N) checkpoints, state dtype; x_ring: (S, H, R, P); dt_ring: (S, H, R)
            processed delta; B_ring: (S, G, R, N): as in ``replay_step_triton``, read only.
        ring_start, history: (S,) int32; is_flush: (S,) bool (from the prepare), read only.
        slots: (rows,) int64, -1 = padded row; a slot appears at most once.
        A: (H,) fp32.
    """
    slots_n, nheads, dim, dstate = state.shape
    ngroups, ring_len = B_ring.shape[1], B_ring.shape[2]
    rows = slots.shape[0]
    if rows == 0:
        return
    launch = dict(FLUSH_CONFIG)
    per_sm = launch.pop("programs_per_sm")
    block_n = max(16, triton.next_power_of_2(dstate))
    launch["FOLD_N"] = min(launch["FOLD_N"], block_n)
    _replay_flush_kernel[(_programs(state.device, per_sm),)](
        state, x_ring, dt_ring, B_ring, ring_start, history, flag_bytes(is_flush), slots, A,
        rows, ring_len, dim, dstate, nheads, nheads // ngroups,
        *state.stride(), *x_ring.stride(), *dt_ring.stride(), *B_ring.stride(),
        BLOCK_ROWS=max(16, triton.next_power_of_2(rows)), BLOCK_N=block_n,
        BLOCK_W=max(16, triton.next_power_of_2(ring_len - 1)), **launch,
    )
