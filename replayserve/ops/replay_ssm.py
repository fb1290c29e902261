"""Reference ReplaySSM ops, Mode B: a checkpoint, exact rings R = W + T of (x, Δ, B), and cursors.

Contract: docs/replayssm-contract.md. Algorithm: docs/replayssm.md (The recurrence: the unrolled
fold/readout; Cursors: verify, commit; Boundary states: materialization). Shapes are per Mamba layer:
    state    (S, H, P, N)  state dtype; the checkpoint S0 of every slot
    x_ring   (S, H, R, P)  activation dtype
    dt_ring  (S, H, R)     state dtype; processed Δ = clamp(softplus(dt + dt_bias), *dt_limit)
    B_ring   (S, G, R, N)  activation dtype; shared by the group's H // G heads
    ring_start, history (S,) int32 and is_flush (S,) bool: shared by all Mamba layers
Logical entry j of slot s lives at physical index ring_index(ring_start[s], j, R). `state[s]` is
the canonical state after `committed - history[s]` tokens; entries 0..history-1 are the inputs of
the next `history` committed tokens. Rows with slot -1 are padding: they touch nothing.

These are plain-PyTorch, device-agnostic references with per-row Python loops; they validate
shapes and cursor ranges and raise ValueError on any mismatch. ``replay_prepare``, ``replay_step``,
``replay_commit`` and ``replay_materialize`` are the backend's entry points: the kernels of
``replay_ssm_triton`` on CUDA, whatever the dtypes (``dispatch.use_triton``), these elsewhere.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.time_step import process_dt


def ring_index(start: int, j: int, ring_len: int) -> int:
    """Physical ring index of logical entry j: (start + j) mod R by one conditional subtraction.

    Both terms are in [0, R), so one subtraction suffices. A bitmask is wrong because R = W + T is
    in general not a power of two: (18 + 5) mod 20 = 3, but (18 + 5) & 19 = 19.
    """
    if not (0 <= start < ring_len and 0 <= j < ring_len):
        raise ValueError(f"ring_index needs 0 <= start={start} < R={ring_len} and 0 <= j={j} < R")
    p = start + j
    return p - ring_len if p >= ring_len else p


def _check_cursors(ring_start: Tensor, history: Tensor, is_flush: Tensor) -> int:
    """Validate the (S,) cursor tensors; return S."""
    num_slots = ring_start.shape[0]
    for name, t, dtype in (("ring_start", ring_start, torch.int32), ("history", history, torch.int32),
                           ("is_flush", is_flush, torch.bool)):
        if t.shape != (num_slots,) or t.dtype != dtype:
            raise ValueError(f"{name} must be ({num_slots},) {dtype}, got {tuple(t.shape)} {t.dtype}")
    return num_slots


def _real_rows(slots: Tensor, num_slots: int, name: str = "slots") -> list[tuple[int, int]]:
    """(row, slot) for every non-padded row; slots must be distinct and in [0, S)."""
    if slots.dim() != 1:
        raise ValueError(f"{name} must be (rows,), got {tuple(slots.shape)}")
    rows = [(row, s) for row, s in enumerate(slots.tolist()) if s != -1]
    real = [s for _, s in rows]
    if any(not 0 <= s < num_slots for s in real) or len(set(real)) != len(real):
        raise ValueError(f"{name} must be distinct slots in [0, {num_slots}) or -1, got {slots.tolist()}")
    return rows


def _step_rows(slots: Tensor, num_slots: int, ring_start: Tensor, history: Tensor, num_tokens: Tensor, tokens: int,
               window: int, ring_len: int) -> list[tuple[int, int, int, int, int]]:
    """(row, slot, n tokens, history m, ring_start) of every non-padded row of a replayed step,
    checked: 1 <= n <= T, 0 <= m <= W, 0 <= ring_start < R."""
    starts, hists, ntok = ring_start.tolist(), history.tolist(), num_tokens.tolist()
    rows = []
    for row, s in _real_rows(slots, num_slots):
        n, m, start = ntok[row], hists[s], starts[s]
        if not (1 <= n <= tokens and 0 <= m <= window and 0 <= start < ring_len):
            raise ValueError(f"row {row} (slot {s}): need 1 <= n={n} <= T={tokens}, 0 <= history={m} <= W={window}, "
                             f"0 <= ring_start={start} < R={ring_len}")
        rows.append((row, s, n, m, start))
    return rows


def _check_rings(state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor) -> tuple[int, ...]:
    """Validate the pool tensors against each other; return (S, H, P, N, G, R)."""
    if state.dim() != 4 or x_ring.dim() != 4 or dt_ring.dim() != 3 or B_ring.dim() != 4:
        raise ValueError("state (S,H,P,N), x_ring (S,H,R,P), dt_ring (S,H,R), B_ring (S,G,R,N) expected, got "
                         f"{tuple(state.shape)}, {tuple(x_ring.shape)}, {tuple(dt_ring.shape)}, {tuple(B_ring.shape)}")
    num_slots, nheads, headdim, dstate = state.shape
    ngroups, ring_len = B_ring.shape[1], dt_ring.shape[2]
    if (x_ring.shape != (num_slots, nheads, ring_len, headdim) or dt_ring.shape != (num_slots, nheads, ring_len)
            or B_ring.shape != (num_slots, ngroups, ring_len, dstate)):
        raise ValueError(f"ring shapes disagree with state {tuple(state.shape)}: x_ring {tuple(x_ring.shape)}, "
                         f"dt_ring {tuple(dt_ring.shape)}, B_ring {tuple(B_ring.shape)}")
    if ngroups < 1 or nheads % ngroups != 0:
        raise ValueError(f"H={nheads} is not a multiple of G={ngroups}")
    return num_slots, nheads, headdim, dstate, ngroups, ring_len


def _gather(x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, slot: int, start: int, first: int, count: int,
            cdt: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """Logical entries first..first+count-1 of a slot, in cdt: Δ (H, E), x (H, E, P), B (H, E, N)."""
    ring_len = dt_ring.shape[2]
    idx = torch.tensor([ring_index(start, first + j, ring_len) for j in range(count)], device=dt_ring.device)
    rep = x_ring.shape[1] // B_ring.shape[1]
    return (dt_ring[slot][:, idx].to(cdt), x_ring[slot][:, idx].to(cdt),
            B_ring[slot][:, idx].to(cdt).repeat_interleave(rep, dim=0))


def _fold(S: Tensor, A: Tensor, delta: Tensor, xs: Tensor, Bs: Tensor) -> Tensor:
    """fold(S, 0..q) = e^{AΓ_q} S + Σ_j Δ_j e^{A(Γ_q − Γ_j)} x_j B_jᵀ over all E = q + 1 entries.

    S (H, P, N), A (H,), delta (H, E), xs (H, E, P), Bs (H, E, N), all in one dtype; returns (H, P, N).
    """
    gamma = torch.cumsum(delta, dim=1)  # Γ is recomputed per call: prefix sums do not survive a flush
    # Each exponent is A·(Γ_q − Γ_j) <= 0, never a ratio of exponentials, so nothing overflows.
    w = delta * torch.exp(A[:, None] * (gamma[:, -1:] - gamma))
    return torch.exp(A * gamma[:, -1])[:, None, None] * S + torch.einsum("he,hep,hen->hpn", w, xs, Bs)


def _readout(S: Tensor, A: Tensor, D: Tensor, delta: Tensor, xs: Tensor, Bs: Tensor, q: int, Cq: Tensor) -> Tensor:
    """readout(S, 0..q) = e^{AΓ_q}(S C_q) + Σ_{j<=q} Δ_j e^{A(Γ_q − Γ_j)} (B_j·C_q) x_j + D x_q.

    Shapes as in _fold (entries past q are sliced away, not masked, so their values never matter);
    D (H,), Cq (H, N). Returns (H, P); no P×N state is formed.
    """
    delta, xs, Bs = delta[:, : q + 1], xs[:, : q + 1], Bs[:, : q + 1]
    gamma = torch.cumsum(delta, dim=1)
    w = delta * torch.exp(A[:, None] * (gamma[:, -1:] - gamma)) * torch.einsum("hjn,hn->hj", Bs, Cq)
    y = torch.exp(A * gamma[:, -1])[:, None] * torch.einsum("hpn,hn->hp", S, Cq)
    return y + torch.einsum("hj,hjp->hp", w, xs) + D[:, None] * xs[:, q]


def replay_prepare_ref(ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
                       fresh: Tensor, window: int) -> None:
    """Before a step, for every real row: reset fresh slots, then recompute is_flush (IN PLACE).

    ring_start, history (S,) int32; is_flush (S,) bool; slots (rows,) int64, -1 = padded;
    num_tokens (rows,) int n in [1, T]; fresh (rows,) bool; window = W. For a real row with slot s:
    if fresh: ring_start[s] = history[s] = 0 (a reset wins over a leftover history); then
    is_flush[s] = history[s] + n > W, always recomputed, never inherited (zero-accept rows too).
    """
    num_slots = _check_cursors(ring_start, history, is_flush)
    if num_tokens.shape != slots.shape or fresh.shape != slots.shape:
        raise ValueError(f"num_tokens {tuple(num_tokens.shape)} and fresh {tuple(fresh.shape)} must match "
                         f"slots {tuple(slots.shape)}")
    ntok, fr = num_tokens.tolist(), fresh.tolist()
    for row, s in _real_rows(slots, num_slots):
        if not 1 <= ntok[row] <= window:
            raise ValueError(f"num_tokens[{row}]={ntok[row]} must be in [1, T] with T <= W={window}")
        if fr[row]:
            ring_start[s] = 0
            history[s] = 0
        is_flush[s] = int(history[s]) + ntok[row] > window  # the row's own n, never T


def replay_step_ref(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> Tensor:
    """One decode/verify step of n <= T tokens per row from checkpoint + ring (contract `replay_step`).

    Arguments:
        state, x_ring, dt_ring, B_ring: the pool (module docstring); rings are appended IN PLACE,
            state[s] is written IN PLACE only on a flush with history > 0.
        ring_start, history, is_flush: (S,) cursors, read only (replay_prepare_ref sets is_flush).
        slots: (rows,) int64, -1 = padded row (touches nothing, output zeros).
        num_tokens: (rows,) int n in [1, T]; positions i >= n are ignored and give zeros.
        x: (rows, T, H, P); dt: (rows, T, H) raw; B, C: (rows, T, G, N); activation dtype.
        A, D, dt_bias: (H,); D and dt_bias may be None. dt_limit: clamp of the processed Δ.

    Per row with m = history, for i < n: (x_i, Δ_i, B_i) goes to logical entry m + i. Without a
    flush y_i = readout(S0, 0..m+i); with one S1 = fold(S0, 0..m-1) becomes the checkpoint and
    y_i = readout(S1, m..m+i). Entries are read back from the rings, so outputs use exactly the
    stored (x, Δ, B) that later replays will see; S1 stays in compute precision for the readout.

    Returns:
        y: (rows, T, H, P) in x.dtype, computed in the wider of state.dtype and compute_dtype(x.dtype).
    """
    num_slots, nheads, headdim, dstate, ngroups, ring_len = _check_rings(state, x_ring, dt_ring, B_ring)
    if _check_cursors(ring_start, history, is_flush) != num_slots:
        raise ValueError(f"cursors have {ring_start.shape[0]} slots, the pool has {num_slots}")
    if x.dim() != 4:
        raise ValueError(f"x must be (rows, T, H, P), got {tuple(x.shape)}")
    rows, tokens = x.shape[:2]
    window = ring_len - tokens
    if not 1 <= tokens <= window:
        raise ValueError(f"ring length R={ring_len} must equal W + T with 1 <= T={tokens} <= W (W would be {window})")
    expect = {"x": (x, (rows, tokens, nheads, headdim)), "dt": (dt, (rows, tokens, nheads)),
              "B": (B, (rows, tokens, ngroups, dstate)), "C": (C, (rows, tokens, ngroups, dstate)),
              "A": (A, (nheads,)), "D": (D, (nheads,)), "dt_bias": (dt_bias, (nheads,)),
              "slots": (slots, (rows,)), "num_tokens": (num_tokens, (rows,))}
    for name, (t, shape) in expect.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    cdt = torch.promote_types(state.dtype, compute_dtype(x.dtype))
    rep = nheads // ngroups

    delta_in = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), True, dt_limit)
    Ac = A.to(cdt)
    Dc = torch.zeros_like(Ac) if D is None else D.to(cdt)
    Ch = C.to(cdt).repeat_interleave(rep, dim=2)  # (rows, T, H, N)
    y = torch.zeros((rows, tokens, nheads, headdim), dtype=cdt, device=x.device)
    flushes = is_flush.tolist()
    for row, s, n, m, start in _step_rows(slots, num_slots, ring_start, history, num_tokens, tokens, window, ring_len):
        # The append slot does not depend on the flush; m + n <= R, so it never hits the history.
        for i in range(n):
            p = ring_index(start, m + i, ring_len)
            x_ring[s, :, p] = x[row, i]
            dt_ring[s, :, p] = delta_in[row, i]
            B_ring[s, :, p] = B[row, i]
        base, first = state[s].to(cdt), 0
        if flushes[s]:
            if m > 0:  # only committed history is folded; this step's window stays in the ring (the lag)
                base = _fold(base, Ac, *_gather(x_ring, dt_ring, B_ring, s, start, 0, m, cdt))
                state[s] = base.to(state.dtype)
            first = m
        delta, xs, Bs = _gather(x_ring, dt_ring, B_ring, s, start, first, m + n - first, cdt)
        for i in range(n):
            y[row, i] = _readout(base, Ac, Dc, delta, xs, Bs, m - first + i, Ch[row, i])
    return y.to(x.dtype)


def replay_commit_ref(ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_accepted: Tensor,
                      ring_len: int) -> None:
    """After sampling, once per step for all layers: advance the cursors IN PLACE.

    ring_start, history (S,) int32; is_flush (S,) bool as set by prepare; slots (rows,) int64,
    -1 = padded; num_accepted (rows,) int (tokens kept, bonus included); ring_len = R. For a real row
    with num_accepted > 0 and a = max(num_accepted, 1): on a flush ring_start = (ring_start + history)
    mod R and history = a (the accepted tail is the new history), else history += a. Rows with
    num_accepted == 0 (held a slot, ran nothing) are skipped.
    """
    num_slots = _check_cursors(ring_start, history, is_flush)
    if num_accepted.shape != slots.shape:
        raise ValueError(f"num_accepted {tuple(num_accepted.shape)} must match slots {tuple(slots.shape)}")
    acc = num_accepted.tolist()
    for row, s in _real_rows(slots, num_slots):
        if acc[row] < 0:
            raise ValueError(f"num_accepted[{row}]={acc[row]} is negative")
        if acc[row] == 0:
            continue
        a, m = max(acc[row], 1), int(history[s])
        if bool(is_flush[s]):
            ring_start[s] = ring_index(int(ring_start[s]), m, ring_len)  # origin moves past the folded history
            history[s] = a
        else:
            history[s] = m + a
        if int(history[s]) >= ring_len:  # history <= W < R always holds when a <= n
            raise ValueError(f"slot {s}: history {int(history[s])} overflows the ring R={ring_len}")


def replay_materialize_ref(state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A: Tensor,
                           src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor) -> None:
    """Fold a source slot's first n ring entries into a boundary state: state[dst] IN PLACE.

    Arguments:
        state, x_ring, dt_ring, B_ring: the pool (module docstring).
        A: (H,) decay rates.
        src, dst: (rows,) int64 slots; a row with either -1 is skipped; dst must be distinct.
        ring_start, n: (rows,) int32; entries 0..n-1 are read from src's ring starting at
            ring_start[row]; 0 <= n[row] < R (callers guarantee n <= history(src) <= W).

    state[dst] = fold(state[src], entries) in the wider of state.dtype and compute_dtype(x_ring.dtype);
    n == 0 is an exact copy. All sources are read before any write, so src (state, rings, cursors) is
    unchanged unless it is itself a dst (align mode on the live slot, valid only with n == history).
    """
    num_slots, *_, ring_len = _check_rings(state, x_ring, dt_ring, B_ring)
    if A.shape != (state.shape[1],):
        raise ValueError(f"A must be ({state.shape[1]},), got {tuple(A.shape)}")
    if src.dim() != 1 or any(t.shape != src.shape for t in (dst, ring_start, n)):
        raise ValueError(f"src, dst, ring_start, n must all be (rows,), got {tuple(src.shape)}, {tuple(dst.shape)}, "
                         f"{tuple(ring_start.shape)}, {tuple(n.shape)}")
    cdt = torch.promote_types(state.dtype, compute_dtype(x_ring.dtype))
    srcs, starts, counts = src.tolist(), ring_start.tolist(), n.tolist()
    pairs = [(row, d) for row, d in _real_rows(dst, num_slots, "dst") if srcs[row] != -1]
    out: list[tuple[int, Tensor]] = []
    for row, d in pairs:
        s, start, k = srcs[row], starts[row], counts[row]
        if not (0 <= s < num_slots and 0 <= start < ring_len and 0 <= k < ring_len):
            raise ValueError(f"row {row}: need 0 <= src={s} < S={num_slots}, 0 <= ring_start={start} < R={ring_len}, "
                             f"0 <= n={k} < R")
        if k == 0:
            out.append((d, state[s].clone()))  # no arithmetic: the copy is bitwise exact
        else:
            entries = _gather(x_ring, dt_ring, B_ring, s, start, 0, k, cdt)
            out.append((d, _fold(state[s].to(cdt), A.to(cdt), *entries).to(state.dtype)))
    for d, value in out:
        state[d] = value


def replay_copy_slot_ref(x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, ring_start: Tensor, history: Tensor,
                         is_flush: Tensor, src: Tensor, dst: Tensor) -> None:
    """Move rings and cursors together from src to dst slots, IN PLACE (the checkpoint moves elsewhere).

    x_ring (S, H, R, P), dt_ring (S, H, R), B_ring (S, G, R, N); cursors (S,); src, dst (rows,) int64.
    dst == -1 skips the row; src == -1 marks a fresh dst, whose cursors are zeroed (rings left as
    they are: with history 0 nothing reads them); src == dst keeps the slot. All sources are read
    before any write, so permutations (e.g. a swap) are well defined.
    """
    num_slots = _check_cursors(ring_start, history, is_flush)
    if src.shape != dst.shape:
        raise ValueError(f"src {tuple(src.shape)} and dst {tuple(dst.shape)} must match")
    tensors = (x_ring, dt_ring, B_ring, ring_start, history, is_flush)
    if any(t.shape[0] != num_slots for t in tensors):
        raise ValueError(f"rings and cursors must all have {num_slots} slots")
    srcs = src.tolist()
    if any(not -1 <= s < num_slots for s in srcs):
        raise ValueError(f"src must be slots in [0, {num_slots}) or -1, got {srcs}")
    moves = [(row, d) for row, d in _real_rows(dst, num_slots, "dst") if srcs[row] != d]
    saved = [[t[srcs[row]].clone() for t in tensors] if srcs[row] != -1 else None for row, _ in moves]
    for (_, d), values in zip(moves, saved, strict=True):
        if values is None:
            ring_start[d], history[d], is_flush[d] = 0, 0, False
        else:
            for t, v in zip(tensors, values, strict=True):
                t[d] = v


def replay_reset_slot_ref(ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor) -> None:
    """Zero the cursors of slots (rows,) int64 IN PLACE (-1 skipped): nothing is left to replay."""
    num_slots = _check_cursors(ring_start, history, is_flush)
    for _, s in _real_rows(slots, num_slots):
        ring_start[s], history[s], is_flush[s] = 0, 0, False


def _pads_skipped(slots: Tensor, pad_slot: int | None) -> Tensor:
    """`slots` with `pad_slot` as -1, the references' padding (they need distinct slots)."""
    return slots if pad_slot is None else slots.masked_fill(slots == pad_slot, -1)


# The entry points. `pad_slot`: a slot that padded rows may name instead of -1 (the fixed-shape
# decode path's, which no pool hands out): the kernels run those rows on it, in parallel and
# harmlessly; the references skip them.

def replay_prepare(ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
                   fresh: Tensor, window: int, pad_slot: int | None = None) -> None:
    """``replay_prepare_ref``, by its kernel where it serves the cursors."""
    if use_triton(ring_start, None):
        from replayserve.ops.replay_cursors_triton import replay_prepare_triton

        replay_prepare_triton(ring_start, history, is_flush, slots, num_tokens, fresh, window)
    else:
        replay_prepare_ref(ring_start, history, is_flush, _pads_skipped(slots, pad_slot), num_tokens, fresh, window)


def replay_step(
    state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None, dt_bias: Tensor | None,
    dt_limit: tuple[float, float] = (0.0, math.inf), pad_slot: int | None = None,
) -> Tensor:
    """``replay_step_ref``, by ``replay_step_triton`` (and the flush kernel) where it serves the pool."""
    if use_triton(state, None):
        from replayserve.ops.replay_ssm_triton import replay_step_triton

        return replay_step_triton(state, x_ring, dt_ring, B_ring, ring_start, history, is_flush, slots, num_tokens,
                                  x, dt, A, B, C, D, dt_bias, dt_limit)
    return replay_step_ref(state, x_ring, dt_ring, B_ring, ring_start, history, is_flush,
                           _pads_skipped(slots, pad_slot), num_tokens, x, dt, A, B, C, D, dt_bias, dt_limit)


def replay_commit(ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_accepted: Tensor,
                  ring_len: int, pad_slot: int | None = None) -> None:
    """``replay_commit_ref``, by its kernel where it serves the cursors."""
    if use_triton(ring_start, None):
        from replayserve.ops.replay_cursors_triton import replay_commit_triton

        replay_commit_triton(ring_start, history, is_flush, slots, num_accepted, ring_len)
    else:
        replay_commit_ref(ring_start, history, is_flush, _pads_skipped(slots, pad_slot), num_accepted, ring_len)


def replay_materialize(state: Tensor, x_ring: Tensor, dt_ring: Tensor, B_ring: Tensor, A: Tensor,
                       src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor) -> None:
    """``replay_materialize_ref``, by its kernel where it serves the pool."""
    if use_triton(state, None):
        from replayserve.ops.replay_ssm_triton import replay_materialize_triton

        replay_materialize_triton(state, x_ring, dt_ring, B_ring, A, src, dst, ring_start, n)
    else:
        replay_materialize_ref(state, x_ring, dt_ring, B_ring, A, src, dst, ring_start, n)
