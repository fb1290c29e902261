"""Reference Mamba2 SSD scan: chunked prefill of one sequence, and of packed sequences."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.dtypes import compute_dtype
from replayserve.ops.time_step import process_dt


def heads_per_group(num_heads: int, num_groups: int) -> int:
    if num_heads % num_groups != 0:
        raise ValueError(f"H={num_heads} is not a multiple of G={num_groups}")
    return num_heads // num_groups


def ssd_chunk_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial_state: Tensor | None = None,
    return_chunk_states: bool = False,
    chunk_phase: int = 0,
) -> tuple[Tensor, Tensor] | tuple[Tensor, Tensor, Tensor]:
    """Mamba2 selective scan of one sequence in chunked (SSD) form.

    Recurrence, with delta = clamp(softplus(dt + dt_bias), *dt_limit) per (t, h):
        S_t = exp(delta_t * A) * S_{t-1} + delta_t * x_t B_t^T    (S_t: (P, N) per head)
        y_t = S_t C_t + D * x_t

    Arguments:
        x: (L, H, P), L >= 1 and any multiple of chunk_size or not.
        dt: (L, H) raw time step.
        A: (H,) negative decay rates (-exp(A_log)).
        B, C: (L, G, N), H % G == 0; head h uses group h // (H // G).
        chunk_size: tokens per chunk of the quadratic intra-chunk form.
        D: (H,) skip connection, or None.
        dt_bias: (H,) or None.
        dt_softplus: apply softplus to dt + dt_bias.
        dt_limit: (min, max) clamp applied to the processed dt.
        initial_state: (H, P, N) or None (zeros).
        return_chunk_states: also return the states on the chunk grid.
        chunk_phase: 0 <= phase < chunk_size tokens of the first chunk that lie before x (x starts
            at a position phase past a grid point of a longer sequence): the first chunk holds
            chunk_size - phase tokens, so the grid stays that of the whole sequence.

    Returns:
        y: (L, H, P) in x.dtype.
        final_state: (H, P, N) in compute_dtype(x.dtype), the state after token L-1.
        chunk_states (if asked): (ceil((L + chunk_phase) / chunk_size), H, P, N), entry c the
            state after the first c * chunk_size - chunk_phase tokens (entry 0 the initial state).
    """
    seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[1], B.shape[2]
    rep = heads_per_group(nheads, ngroups)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    if not 0 <= chunk_phase < chunk_size:
        raise ValueError(f"chunk_phase must be in [0, {chunk_size}), got {chunk_phase}")
    cdt = compute_dtype(x.dtype)

    delta = process_dt(dt.to(cdt), None if dt_bias is None else dt_bias.to(cdt), dt_softplus, dt_limit)
    xc = x.to(cdt)
    Bh = B.to(cdt).repeat_interleave(rep, dim=1)  # (L, H, N)
    Ch = C.to(cdt).repeat_interleave(rep, dim=1)

    # Padding with delta = 0 and x = B = C = 0 makes the extra tokens an exact
    # identity on the state (decay exp(0) = 1, zero input), so neither a first
    # chunk that starts mid-grid nor the last chunk needs special casing, and
    # the final state is unaffected.
    nchunks = -(-(seqlen + chunk_phase) // chunk_size)
    pad = nchunks * chunk_size - seqlen - chunk_phase

    def chunked(t: Tensor) -> Tensor:
        t = F.pad(t, (0, 0) * (t.dim() - 1) + (chunk_phase, pad))
        return t.reshape(nchunks, chunk_size, *t.shape[1:])

    xs, dts, Bs, Cs = chunked(xc), chunked(delta), chunked(Bh), chunked(Ch)
    dA = dts * A.to(cdt)  # (c, Q, H), <= 0
    cum = torch.cumsum(dA, dim=1)  # inclusive, per chunk

    # Intra-chunk (diagonal blocks): y_i += sum_{j<=i} exp(cum_i - cum_j) (C_i.B_j) delta_j x_j.
    # The difference is masked to -inf above the diagonal before exp, since
    # there it is positive and could overflow into inf * 0 = nan.
    seg = cum[:, :, None, :] - cum[:, None, :, :]  # (c, i, j, H)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay_ij = torch.exp(seg.masked_fill(~causal[None, :, :, None], float("-inf")))
    scores = torch.einsum("cihn,cjhn->cijh", Cs, Bs) * decay_ij
    y = torch.einsum("cijh,cjh,cjhp->cihp", scores, dts, xs)

    # Each chunk's own contribution to the state at its last token.
    decay_to_end = torch.exp(cum[:, -1:, :] - cum)  # (c, Q, H)
    chunk_states = torch.einsum("cjh,cjh,cjhp,cjhn->chpn", decay_to_end, dts, xs, Bs)

    # State passing between chunks is sequential over chunks only; each step
    # decays by one chunk's total, so no long-range cumsum difference can lose
    # precision by cancellation.
    if initial_state is None:
        state = x.new_zeros((nheads, headdim, dstate), dtype=cdt)
    else:
        state = initial_state.to(cdt)
    chunk_total = torch.exp(cum[:, -1, :])  # (c, H)
    states_in = []
    for c in range(nchunks):
        states_in.append(state)
        state = chunk_total[c][:, None, None] * state + chunk_states[c]
    prev = torch.stack(states_in)  # (c, H, P, N): state entering each chunk

    # Off-diagonal: the carried-in state decayed to each position, read out by C.
    y = y + torch.einsum("cih,cihn,chpn->cihp", torch.exp(cum), Cs, prev)
    y = y.reshape(nchunks * chunk_size, nheads, headdim)[chunk_phase : chunk_phase + seqlen]
    if D is not None:
        y = y + D.to(cdt)[:, None] * xc
    if return_chunk_states:
        return y.to(x.dtype), state, prev
    return y.to(x.dtype), state


def ssd_varlen_scan_ref(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    cu_seqlens: Tensor,
    chunk_phase: Tensor,
    ssm_state: Tensor,
    state_slots: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_grid_states: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``ssd_chunk_scan_ref`` over S packed sequences, each from and back into its state slot.

    Arguments:
        x: (T, H, P) the tokens of all sequences, sequence s at rows cu_seqlens[s]:cu_seqlens[s+1].
        dt: (T, H) raw time step; A, D, dt_bias, dt_softplus, dt_limit: as in ``ssd_chunk_scan_ref``.
        B, C: (T, G, N).
        cu_seqlens: (S+1,) int, ascending from 0 to T; every sequence has at least one token.
        chunk_phase: (S,) int in [0, chunk_size), each sequence's first position modulo chunk_size.
        ssm_state: (slots, H, P, N) state pool; row state_slots[s] is sequence s's initial state
            and is overwritten IN PLACE with its final state (in ssm_state.dtype).
        state_slots: (S,) int, distinct.
        return_grid_states: also return the states on each sequence's chunk grid.

    Returns:
        y: (T, H, P) in x.dtype.
        grid_states (if asked): (sum_s ceil((L_s + phase_s) / chunk_size), H, P, N) in
            compute_dtype(x.dtype): sequence s's ``chunk_states`` (entry 0 its initial state, entry
            c the state after its first c * chunk_size - phase_s tokens), concatenated over s.
    """
    bounds, phases, slots = cu_seqlens.tolist(), chunk_phase.tolist(), state_slots.tolist()
    if len(bounds) != len(slots) + 1 or len(phases) != len(slots):
        raise ValueError(f"cu_seqlens must be (S+1,) and chunk_phase (S,) for S={len(slots)} state slots")
    ys, grids = [], []
    for s, slot in enumerate(slots):
        lo, hi = bounds[s], bounds[s + 1]
        y, final, *grid = ssd_chunk_scan_ref(
            x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], chunk_size, D=D, dt_bias=dt_bias, dt_softplus=dt_softplus,
            dt_limit=dt_limit, initial_state=ssm_state[slot], return_chunk_states=return_grid_states,
            chunk_phase=phases[s],
        )
        ssm_state[slot] = final.to(ssm_state.dtype)
        ys.append(y)
        grids += grid
    y = torch.cat(ys)
    return (y, torch.cat(grids)) if return_grid_states else y
