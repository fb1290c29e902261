"""Reference ReplaySSM ops for Gated DeltaNet: a checkpoint, exact rings R = W + T of (k, v, g, beta).

Algorithm and cursor rules: docs/replayssm.md (section Gated DeltaNet). Shapes are per GDN layer:
    state      (S, Hv, K, V)  state dtype; the checkpoint S0 of every slot
    k_ring     (S, Hk, R, K)  activation dtype; keys as the layer feeds them (before the L2 norm),
                              shared by the Hv // Hk value heads of a key head
    v_ring     (S, Hv, R, V)  activation dtype
    g_ring     (S, Hv, R)     state dtype; log-space decays
    beta_ring  (S, Hv, R)     state dtype
    ring_start, history (S,) int32 and is_flush (S,) bool: the cursors of ``replay_ssm``, with the
    same meaning and the same ops (``replay_prepare``, ``replay_commit``): shared by all GDN layers.
Logical entry j of slot s lives at physical index ring_index(ring_start[s], j, R). `state[s]` is the
canonical state after `committed - history[s]` tokens; entries 0..history-1 are the inputs of the
next `history` committed tokens. Rows with slot -1 are padding: they touch nothing.

The queries are never stored: a read needs only the current tokens' q. Keys are stored raw and
normalized on every read, so a replay sees exactly the keys the baseline step normalizes.

These are plain-PyTorch, device-agnostic references with per-row Python loops, built on the WY
chunk form (``gated_delta.wy_chunk_ref``). ``replay_gdn_step`` and ``replay_gdn_materialize`` are
the backend's entry points: the kernels of ``replay_gdn_triton`` on CUDA (``dispatch.use_triton``),
these elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.gated_delta import expand_key_heads, l2norm_ref, wy_chunk_ref
from replayserve.ops.replay_ssm import _check_cursors, _pads_skipped, _real_rows, _step_rows, ring_index


def _check_rings(state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor) -> tuple[int, ...]:
    """Validate the pool tensors against each other; return (S, Hv, K, V, Hk, R)."""
    if state.dim() != 4 or k_ring.dim() != 4 or v_ring.dim() != 4 or g_ring.dim() != 3:
        raise ValueError("state (S,Hv,K,V), k_ring (S,Hk,R,K), v_ring (S,Hv,R,V), g_ring, beta_ring (S,Hv,R) "
                         f"expected, got {tuple(state.shape)}, {tuple(k_ring.shape)}, {tuple(v_ring.shape)}, "
                         f"{tuple(g_ring.shape)}")
    num_slots, hv, dk, dv = state.shape
    hk, ring_len = k_ring.shape[1], g_ring.shape[2]
    if (k_ring.shape != (num_slots, hk, ring_len, dk) or v_ring.shape != (num_slots, hv, ring_len, dv)
            or g_ring.shape != (num_slots, hv, ring_len) or beta_ring.shape != g_ring.shape):
        raise ValueError(f"ring shapes disagree with state {tuple(state.shape)}: k_ring {tuple(k_ring.shape)}, "
                         f"v_ring {tuple(v_ring.shape)}, g_ring {tuple(g_ring.shape)}, "
                         f"beta_ring {tuple(beta_ring.shape)}")
    if hk < 1 or hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    return num_slots, hv, dk, dv, hk, ring_len


def _entries(rings: tuple[Tensor, ...], slot: int, start: int, count: int, cdt: torch.dtype,
             use_qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Logical entries 0..count-1 of a slot, prepared in cdt: k (E, Hv, K), v (E, Hv, V), g, beta (E, Hv)."""
    k_ring, v_ring, g_ring, beta_ring = rings
    ring_len = g_ring.shape[2]
    idx = torch.tensor([ring_index(start, j, ring_len) for j in range(count)], device=g_ring.device, dtype=torch.long)
    v = v_ring[slot][:, idx].transpose(0, 1).to(cdt)
    k = _keys(k_ring[slot][:, idx].transpose(0, 1), v.shape[1], cdt, use_qk_l2norm)
    return k, v, g_ring[slot][:, idx].T.to(cdt), beta_ring[slot][:, idx].T.to(cdt)


def _keys(x: Tensor, num_v_heads: int, cdt: torch.dtype, use_qk_l2norm: bool) -> Tensor:
    """Keys or queries (..., Hk, K) -> (..., Hv, K) in cdt, L2-normalized if the layer asks."""
    x = expand_key_heads(x, num_v_heads).to(cdt)
    return l2norm_ref(x) if use_qk_l2norm else x


def _fold(state: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
    """The state after the entries, from `state` (Hv, K, V); entries as ``_entries`` gives them."""
    return wy_chunk_ref(state, torch.zeros_like(k), k, v, g, beta)[1]


def replay_gdn_step_ref(
    state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False,
) -> Tensor:
    """One decode/verify step of n <= T tokens per row from checkpoint + ring.

    Arguments:
        state, k_ring, v_ring, g_ring, beta_ring: the pool (module docstring); rings are appended IN
            PLACE, state[s] is written IN PLACE only on a flush with history > 0.
        ring_start, history, is_flush: (S,) cursors, read only (``replay_prepare`` sets is_flush).
        slots: (rows,) int64, -1 = padded row (touches nothing, output zeros).
        num_tokens: (rows,) int n in [1, T]; positions i >= n are ignored and give zeros.
        q, k: (rows, T, Hk, K); v: (rows, T, Hv, V); g, beta: (rows, T, Hv).
        scale, use_qk_l2norm: as in ``gated_delta_recurrent_ref``.

    Per row with m = history, for i < n: (k_i, v_i, g_i, beta_i) goes to logical entry m + i.
    Without a flush o_i = the output of token m + i replayed from S0 over entries 0..m+i; with one,
    S1 = the state after entries 0..m-1 becomes the checkpoint and o_i is replayed from S1 over
    entries m..m+i. Entries are read back from the rings, so outputs use exactly the stored values.

    Returns:
        o: (rows, T, Hv, V) in v's dtype, computed in the wider of state.dtype and compute_dtype(v.dtype).
    """
    num_slots, hv, dk, dv, hk, ring_len = _check_rings(state, k_ring, v_ring, g_ring, beta_ring)
    if _check_cursors(ring_start, history, is_flush) != num_slots:
        raise ValueError(f"cursors have {ring_start.shape[0]} slots, the pool has {num_slots}")
    rows, tokens = v.shape[:2]
    window = ring_len - tokens
    if not 1 <= tokens <= window:
        raise ValueError(f"ring length R={ring_len} must equal W + T with 1 <= T={tokens} <= W (W would be {window})")
    expect = {"q": (q, (rows, tokens, hk, dk)), "k": (k, (rows, tokens, hk, dk)), "v": (v, (rows, tokens, hv, dv)),
              "g": (g, (rows, tokens, hv)), "beta": (beta, (rows, tokens, hv)), "slots": (slots, (rows,)),
              "num_tokens": (num_tokens, (rows,))}
    for name, (t, shape) in expect.items():
        if t.shape != shape:
            raise ValueError(f"{name} must be {shape}, got {tuple(t.shape)}")
    cdt = torch.promote_types(state.dtype, compute_dtype(v.dtype))
    rings = (k_ring, v_ring, g_ring, beta_ring)
    qc = _keys(q, hv, cdt, use_qk_l2norm) * (dk ** -0.5 if scale is None else scale)  # (rows, T, Hv, K)
    o = torch.zeros(rows, tokens, hv, dv, dtype=cdt, device=v.device)
    flushes = is_flush.tolist()
    for row, s, n, m, start in _step_rows(slots, num_slots, ring_start, history, num_tokens, tokens, window, ring_len):
        for i in range(n):  # m + n <= R: the appends never land on the history
            p = ring_index(start, m + i, ring_len)
            k_ring[s, :, p] = k[row, i]
            v_ring[s, :, p] = v[row, i]
            g_ring[s, :, p] = g[row, i]
            beta_ring[s, :, p] = beta[row, i]
        kk, vv, gg, bb = _entries(rings, s, start, m + n, cdt, use_qk_l2norm)
        base, first = state[s].to(cdt), 0
        if flushes[s]:
            if m > 0:  # only committed history is folded; this step's tokens stay in the ring (the lag)
                base = _fold(base, kk[:m], vv[:m], gg[:m], bb[:m])
                state[s] = base.to(state.dtype)
            first = m
        queries = torch.zeros_like(kk[first:])
        queries[m - first:] = qc[row, :n]
        o[row, :n] = wy_chunk_ref(base, queries, kk[first:], vv[first:], gg[first:], bb[first:])[0][m - first:]
    return o.to(v.dtype)


def replay_gdn_materialize_ref(
    state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
    src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor, use_qk_l2norm: bool = False,
) -> None:
    """Fold a source slot's first n ring entries into a boundary state: state[dst] IN PLACE.

    Arguments:
        state, k_ring, v_ring, g_ring, beta_ring: the pool (module docstring).
        src, dst: (rows,) int64 slots; a row with either -1 is skipped; dst must be distinct.
        ring_start, n: (rows,) int32; entries 0..n-1 are read from src's ring starting at
            ring_start[row]; 0 <= n[row] < R (callers guarantee n <= history(src) <= W).
        use_qk_l2norm: as the layer's steps (the ring holds raw keys).

    state[dst] = the state after the entries from state[src], in the wider of state.dtype and
    compute_dtype(v_ring.dtype); n == 0 is an exact copy. All sources are read before any write, so
    src is unchanged unless it is itself a dst. A flush is this op with src = dst = the slot,
    ring_start and n = its cursors' ring_start and history.
    """
    num_slots, *_, ring_len = _check_rings(state, k_ring, v_ring, g_ring, beta_ring)
    if src.dim() != 1 or any(t.shape != src.shape for t in (dst, ring_start, n)):
        raise ValueError(f"src, dst, ring_start, n must all be (rows,), got {tuple(src.shape)}, {tuple(dst.shape)}, "
                         f"{tuple(ring_start.shape)}, {tuple(n.shape)}")
    cdt = torch.promote_types(state.dtype, compute_dtype(v_ring.dtype))
    srcs, starts, counts = src.tolist(), ring_start.tolist(), n.tolist()
    out: list[tuple[int, Tensor]] = []
    for row, d in _real_rows(dst, num_slots, "dst"):
        s, start, count = srcs[row], starts[row], counts[row]
        if s == -1:
            continue
        if not (0 <= s < num_slots and 0 <= start < ring_len and 0 <= count < ring_len):
            raise ValueError(f"row {row}: need 0 <= src={s} < S={num_slots}, 0 <= ring_start={start} < R={ring_len}, "
                             f"0 <= n={count} < R")
        if count == 0:
            out.append((d, state[s].clone()))  # no arithmetic: the copy is bitwise exact
        else:
            entries = _entries((k_ring, v_ring, g_ring, beta_ring), s, start, count, cdt, use_qk_l2norm)
            out.append((d, _fold(state[s].to(cdt), *entries).to(state.dtype)))
    for d, value in out:
        state[d] = value


# The entry points. `pad_slot`: a slot that padded rows may name instead of -1 (the fixed-shape
# decode path's, which no pool hands out): the kernels run those rows on it, in parallel and
# harmlessly; the references skip them. The cursors move by ``replay_ssm.replay_prepare`` and
# ``replay_ssm.replay_commit``, once per step for all GDN layers.

def replay_gdn_step(
    state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False, pad_slot: int | None = None,
) -> Tensor:
    """``replay_gdn_step_ref``, by ``replay_gdn_step_triton`` (read kernel, then flush) where it serves the pool."""
    _check_rings(state, k_ring, v_ring, g_ring, beta_ring)
    if use_triton(state, None):
        from replayserve.ops.replay_gdn_triton import replay_gdn_step_triton

        return replay_gdn_step_triton(state, k_ring, v_ring, g_ring, beta_ring, ring_start, history, is_flush, slots,
                                      num_tokens, q, k, v, g, beta, scale, use_qk_l2norm)
    return replay_gdn_step_ref(state, k_ring, v_ring, g_ring, beta_ring, ring_start, history, is_flush,
                               _pads_skipped(slots, pad_slot), num_tokens, q, k, v, g, beta, scale, use_qk_l2norm)


def replay_gdn_materialize(state: Tensor, k_ring: Tensor, v_ring: Tensor, g_ring: Tensor, beta_ring: Tensor,
                           src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor,
                           use_qk_l2norm: bool = False) -> None:
    """``replay_gdn_materialize_ref``, by its kernel where it serves the pool."""
    _check_rings(state, k_ring, v_ring, g_ring, beta_ring)
    if use_triton(state, None):
        from replayserve.ops.replay_gdn_triton import replay_gdn_materialize_triton

        replay_gdn_materialize_triton(state, k_ring, v_ring, g_ring, beta_ring, src, dst, ring_start, n, use_qk_l2norm)
    else:
        replay_gdn_materialize_ref(state, k_ring, v_ring, g_ring, beta_ring, src, dst, ring_start, n, use_qk_l2norm)
