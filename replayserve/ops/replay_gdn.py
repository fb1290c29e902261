"""Reference ReplaySSM ops for Gated DeltaNet: a checkpoint, exact rings R = W + T of (k, delta, g).

Algorithm and cursor rules: docs/replayssm.md (section Gated DeltaNet). Shapes are per GDN layer:
    state        (S, Hv, K, V)  state dtype; the checkpoint S0 of every slot
    k_ring       (S, Hk, R, K)  activation dtype; keys as the layer feeds them (before the L2 norm),
                                shared by the Hv // Hk value heads of a key head
    delta_ring   (S, Hv, R, V)  state dtype; each token's correction delta_j = beta_j (v_j - S_-^T k_j),
                                S_- = exp(g_j) times the state before token j (k_j normalized)
    g_ring       (S, Hv, R)     state dtype; log-space decays
    ring_start, history (S,) int32 and is_flush (S,) bool: the cursors of ``replay_ssm``, with the
    same meaning and the same ops (``replay_prepare``, ``replay_commit``): shared by all GDN layers.
Logical entry j of slot s lives at physical index ring_index(ring_start[s], j, R). `state[s]` is the
canonical state after `committed - history[s]` tokens; entries 0..history-1 are the next `history`
committed tokens. Rows with slot -1 are padding: they touch nothing.

Token j moves the state by S_j = exp(g_j) S_{j-1} + k_j delta_j^T, so with G the cumulative decays
from the ring's origin the state after entries 0..i is exp(G_i) S0 + sum_{j<=i} exp(G_i - G_j) k_j delta_j^T.
delta_j depends on the true state before token j, not on where the checkpoint is: it is computed once,
when the token is appended, and stays valid through flushes (the origin moves, the entry does not
change) and rollbacks (a rejected token's entry lies past `history` and is overwritten). A replayed
read is then one product with S0 plus a weighted sum of stored deltas: no triangular solve over the
history, and neither v nor beta is kept.

The queries are never stored: a read needs only the current tokens' q. Keys are stored raw and
normalized on every read, so a replay sees exactly the keys the baseline step normalizes.

These are plain-PyTorch, device-agnostic references with per-row Python loops: the fold of the
history, then the token-by-token recurrence over the step's tokens. ``replay_gdn_step`` and
``replay_gdn_materialize`` are the backend's entry points: the kernels of ``replay_gdn_triton`` on
CUDA (``dispatch.use_triton``), these elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.gated_delta import expand_key_heads, l2norm_ref
from replayserve.ops.replay_ssm import _check_cursors, _pads_skipped, _real_rows, _step_rows, ring_index


def _check_rings(state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor) -> tuple[int, ...]:
    """Validate the pool tensors against each other; return (S, Hv, K, V, Hk, R)."""
    if state.dim() != 4 or k_ring.dim() != 4 or delta_ring.dim() != 4 or g_ring.dim() != 3:
        raise ValueError("state (S,Hv,K,V), k_ring (S,Hk,R,K), delta_ring (S,Hv,R,V), g_ring (S,Hv,R) expected, "
                         f"got {tuple(state.shape)}, {tuple(k_ring.shape)}, {tuple(delta_ring.shape)}, "
                         f"{tuple(g_ring.shape)}")
    num_slots, hv, dk, dv = state.shape
    hk, ring_len = k_ring.shape[1], g_ring.shape[2]
    if (k_ring.shape != (num_slots, hk, ring_len, dk) or delta_ring.shape != (num_slots, hv, ring_len, dv)
            or g_ring.shape != (num_slots, hv, ring_len)):
        raise ValueError(f"ring shapes disagree with state {tuple(state.shape)}: k_ring {tuple(k_ring.shape)}, "
                         f"delta_ring {tuple(delta_ring.shape)}, g_ring {tuple(g_ring.shape)}")
    if hk < 1 or hv % hk:
        raise ValueError(f"value heads {hv} are not a multiple of key heads {hk}")
    return num_slots, hv, dk, dv, hk, ring_len


def _entries(rings: tuple[Tensor, ...], slot: int, start: int, count: int, cdt: torch.dtype,
             use_qk_l2norm: bool) -> tuple[Tensor, Tensor, Tensor]:
    """Logical entries 0..count-1 of a slot, prepared in cdt: k (E, Hv, K), delta (E, Hv, V), g (E, Hv)."""
    k_ring, delta_ring, g_ring = rings
    ring_len = g_ring.shape[2]
    idx = torch.tensor([ring_index(start, j, ring_len) for j in range(count)], device=g_ring.device, dtype=torch.long)
    delta = delta_ring[slot][:, idx].transpose(0, 1).to(cdt)
    k = _keys(k_ring[slot][:, idx].transpose(0, 1), delta.shape[1], cdt, use_qk_l2norm)
    return k, delta, g_ring[slot][:, idx].T.to(cdt)


def _keys(x: Tensor, num_v_heads: int, cdt: torch.dtype, use_qk_l2norm: bool) -> Tensor:
    """Keys or queries (..., Hk, K) -> (..., Hv, K) in cdt, L2-normalized if the layer asks."""
    x = expand_key_heads(x, num_v_heads).to(cdt)
    return l2norm_ref(x) if use_qk_l2norm else x


def _fold(state: Tensor, k: Tensor, delta: Tensor, g: Tensor) -> Tensor:
    """The state (Hv, K, V) after the entries (as ``_entries`` gives them): exp(G_last) S + sum_j
    exp(G_last - G_j) k_j delta_j^T, each exponent a difference <= 0."""
    cum = g.cumsum(0)  # (E, Hv)
    to_end = torch.exp(cum[-1] - cum)  # (E, Hv)
    return torch.exp(cum[-1])[:, None, None] * state + torch.einsum("eh,ehk,ehv->hkv", to_end, k, delta)


def replay_gdn_step_ref(
    state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False,
) -> Tensor:
    """One decode/verify step of n <= T tokens per row from checkpoint + ring.

    Arguments:
        state, k_ring, delta_ring, g_ring: the pool (module docstring); rings are appended IN PLACE,
            state[s] is written IN PLACE only on a flush with history > 0.
        ring_start, history, is_flush: (S,) cursors, read only (``replay_prepare`` sets is_flush).
        slots: (rows,) int64, -1 = padded row (touches nothing, output zeros).
        num_tokens: (rows,) int n in [1, T]; positions i >= n are ignored and give zeros.
        q, k: (rows, T, Hk, K); v: (rows, T, Hv, V); g, beta: (rows, T, Hv).
        scale, use_qk_l2norm: as in ``gated_delta_recurrent_ref``.

    Per row with m = history: S_m = the state after entries 0..m-1 (folded from S0); with a flush it
    becomes the checkpoint. Then token i < n runs the recurrence from S_m: its (k_i, delta_i, g_i) goes
    to logical entry m + i (delta rounded to the ring's dtype first, so outputs use the stored value)
    and o_i = S_{m+i}^T q_i.

    Returns:
        o: (rows, T, Hv, V) in v's dtype, computed in the wider of state.dtype and compute_dtype(v.dtype).
    """
    num_slots, hv, dk, dv, hk, ring_len = _check_rings(state, k_ring, delta_ring, g_ring)
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
    qc = _keys(q, hv, cdt, use_qk_l2norm) * (dk ** -0.5 if scale is None else scale)  # (rows, T, Hv, K)
    kc = _keys(k.to(k_ring.dtype), hv, cdt, use_qk_l2norm)  # the keys as the ring will give them back
    vc, gc, bc = v.to(cdt), g.to(g_ring.dtype).to(cdt), beta.to(cdt)
    o = torch.zeros(rows, tokens, hv, dv, dtype=cdt, device=v.device)
    flushes = is_flush.tolist()
    for row, s, n, m, start in _step_rows(slots, num_slots, ring_start, history, num_tokens, tokens, window, ring_len):
        s_cur = state[s].to(cdt)
        if m > 0:
            s_cur = _fold(s_cur, *_entries((k_ring, delta_ring, g_ring), s, start, m, cdt, use_qk_l2norm))
            if flushes[s]:  # only committed history is folded; this step's tokens stay in the ring (the lag)
                state[s] = s_cur.to(state.dtype)
        for i in range(n):  # m + n <= R: the appends never land on the history
            s_cur = torch.exp(gc[row, i])[:, None, None] * s_cur
            delta = bc[row, i][:, None] * (vc[row, i] - torch.einsum("hkv,hk->hv", s_cur, kc[row, i]))
            delta = delta.to(delta_ring.dtype).to(cdt)
            s_cur = s_cur + kc[row, i][:, :, None] * delta[:, None, :]
            o[row, i] = torch.einsum("hkv,hk->hv", s_cur, qc[row, i])
            p = ring_index(start, m + i, ring_len)
            k_ring[s, :, p] = k[row, i]
            delta_ring[s, :, p] = delta.to(delta_ring.dtype)
            g_ring[s, :, p] = g[row, i]
    return o.to(v.dtype)


def replay_gdn_materialize_ref(
    state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor,
    src: Tensor, dst: Tensor, ring_start: Tensor, n: Tensor, use_qk_l2norm: bool = False,
) -> None:
    """Fold a source slot's first n ring entries into a boundary state: state[dst] IN PLACE.

    Arguments:
        state, k_ring, delta_ring, g_ring: the pool (module docstring).
        src, dst: (rows,) int64 slots; a row with either -1 is skipped; dst must be distinct.
        ring_start, n: (rows,) int32; entries 0..n-1 are read from src's ring starting at
            ring_start[row]; 0 <= n[row] < R (callers guarantee n <= history(src) <= W).
        use_qk_l2norm: as the layer's steps (the ring holds raw keys).

    state[dst] = the state after the entries from state[src], in the wider of state.dtype and
    compute_dtype(k_ring.dtype); n == 0 is an exact copy. All sources are read before any write, so
    src is unchanged unless it is itself a dst. A flush is this op with src = dst = the slot,
    ring_start and n = its cursors' ring_start and history.
    """
    num_slots, *_, ring_len = _check_rings(state, k_ring, delta_ring, g_ring)
    if src.dim() != 1 or any(t.shape != src.shape for t in (dst, ring_start, n)):
        raise ValueError(f"src, dst, ring_start, n must all be (rows,), got {tuple(src.shape)}, {tuple(dst.shape)}, "
                         f"{tuple(ring_start.shape)}, {tuple(n.shape)}")
    cdt = torch.promote_types(state.dtype, compute_dtype(k_ring.dtype))
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
            entries = _entries((k_ring, delta_ring, g_ring), s, start, count, cdt, use_qk_l2norm)
            out.append((d, _fold(state[s].to(cdt), *entries).to(state.dtype)))
    for d, value in out:
        state[d] = value


# The entry points. `pad_slot`: a slot that padded rows may name instead of -1 (the fixed-shape
# decode path's, which no pool hands out): the kernels run those rows on it, in parallel and
# harmlessly; the references skip them. The cursors move by ``replay_ssm.replay_prepare`` and
# ``replay_ssm.replay_commit``, once per step for all GDN layers.

def replay_gdn_step(
    state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor,
    ring_start: Tensor, history: Tensor, is_flush: Tensor, slots: Tensor, num_tokens: Tensor,
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    scale: float | None = None, use_qk_l2norm: bool = False, pad_slot: int | None = None,
) -> Tensor:
    """``replay_gdn_step_ref``, by ``replay_gdn_step_triton`` (read kernel, then flush) where it serves the pool."""
    _check_rings(state, k_ring, delta_ring, g_ring)
    if use_triton(state, None):
        from replayserve.ops.replay_gdn_triton import replay_gdn_step_triton

        return replay_gdn_step_triton(state, k_ring, delta_ring, g_ring, ring_start, history, is_flush, slots,
                                      num_tokens, q, k, v, g, beta, scale, use_qk_l2norm)
    return replay_gdn_step_ref(state, k_ring, delta_ring, g_ring, ring_start, history, is_flush,
                               _pads_skipped(slots, pad_slot), num_tokens, q, k, v, g, beta, scale, use_qk_l2norm)


def replay_gdn_materialize(state: Tensor, k_ring: Tensor, delta_ring: Tensor, g_ring: Tensor, src: Tensor,
                           dst: Tensor, ring_start: Tensor, n: Tensor, use_qk_l2norm: bool = False) -> None:
    """``replay_gdn_materialize_ref``, by its kernel where it serves the pool."""
    _check_rings(state, k_ring, delta_ring, g_ring)
    if use_triton(state, None):
        from replayserve.ops.replay_gdn_triton import replay_gdn_materialize_triton

        replay_gdn_materialize_triton(state, k_ring, delta_ring, g_ring, src, dst, ring_start, n, use_qk_l2norm)
    else:
        replay_gdn_materialize_ref(state, k_ring, delta_ring, g_ring, src, dst, ring_start, n, use_qk_l2norm)
