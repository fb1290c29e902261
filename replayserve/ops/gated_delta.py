"""The gated delta rule (Gated DeltaNet's state update), plain-PyTorch references.

One head's state S is a (K, V) matrix. For each token t, with the key k_t and query q_t
L2-normalized (where the model asks for it) and q_t scaled by K ** -0.5:

    S   <- exp(g_t) * S                        g_t <= 0: the log-space decay
    S   <- S + beta_t * k_t (v_t - S^T k_t)^T   the delta rule: write v_t at key k_t, rate beta_t
    o_t  = S^T q_t

so S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T: an affine recurrence whose
transition is a scaled rank-1 update of the identity. Value heads may outnumber key heads (GQA
style): each key/query head serves ``Hv // Hk`` consecutive value heads, as in Hugging Face's
Qwen3-Next and flash-linear-attention.

Forms: ``gated_delta_recurrent_ref`` (token by token: the definition), ``gated_delta_chunk_ref``
(packed varlen prefill in the WY form, with boundary captures), ``gated_delta_step`` (the decode
step on a state pool, in place) and ``gated_delta_verify`` (T tokens per row, the pool untouched,
the state after every token kept for the commit); their kernels are in ``gated_delta_triton``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype


def l2norm_ref(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, as flash-linear-attention and Hugging Face compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def expand_key_heads(x: Tensor, num_v_heads: int) -> Tensor:
    """(..., Hk, K) -> (..., Hv, K): each key head repeated for the Hv // Hk value heads it serves."""
    hk = x.shape[-2]
    if hk == num_v_heads:
        return x
    if num_v_heads % hk:
        raise ValueError(f"value heads {num_v_heads} are not a multiple of key heads {hk}")
    return x.repeat_interleave(num_v_heads // hk, dim=-2)


def gated_delta_recurrent_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
) -> tuple[Tensor, Tensor]:
    """The gated delta rule token by token: the reference every other form is tested against.

    Arguments:
        q, k: (B, T, Hk, K); v: (B, T, Hv, V), Hv % Hk == 0.
        g: (B, T, Hv) log-space decay; beta: (B, T, Hv) write strength.
        initial_state: (B, Hv, K, V) or None (zeros).
        scale: the query's scale, K ** -0.5 by default.
        use_qk_l2norm: L2-normalize q and k first (in the compute dtype).

    Returns:
        o (B, T, Hv, V) in v's dtype, and the final state (B, Hv, K, V) in the compute dtype
        (float32 for half-precision inputs, else the input dtype: float64 stays float64).
    """
    out_dtype, (hv, dk) = v.dtype, (v.shape[-2], k.shape[-1])
    q, k, v, g, beta = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm)
    cdt = v.dtype
    b, t_len = v.shape[:2]
    state = (torch.zeros(b, hv, dk, v.shape[-1], dtype=cdt, device=v.device) if initial_state is None
             else initial_state.to(cdt).clone())
    out = torch.empty_like(v)
    for t in range(t_len):
        state = state * g[:, t].exp()[..., None, None]
        read = torch.einsum("bhkv,bhk->bhv", state, k[:, t])
        delta = (v[:, t] - read) * beta[:, t][..., None]
        state = state + k[:, t][..., :, None] * delta[..., None, :]
        out[:, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, t])
    return out.to(out_dtype), state


def _prepare_qkv(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
                 use_qk_l2norm: bool) -> tuple[Tensor, ...]:
    """Inputs of any leading shape (..., H, D) -> the compute dtype, key heads expanded, q/k
    normalized (if asked) and q scaled: the form every reference runs the rule on."""
    cdt = compute_dtype(v.dtype)
    hv, dk = v.shape[-2], k.shape[-1]
    q, k = (expand_key_heads(t, hv).to(cdt) for t in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    return q * (dk ** -0.5 if scale is None else scale), k, v.to(cdt), g.to(cdt), beta.to(cdt)


def wy_chunk_ref(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> tuple[Tensor, Tensor]:
    """L tokens of the gated delta rule at once, in the WY (UT-transform) form; all heads.

    Arguments (one dtype, already prepared: key heads expanded, q/k normalized, q scaled):
        state: (H, K, V) the state before the chunk.
        q, k: (L, H, K); v: (L, H, V); g, beta: (L, H).

    With G_i = g_0 + ... + g_i and the intra-chunk decays D_ij = exp(G_i - G_j) (j <= i), each
    token's correction delta_i = beta_i (v_i - (decayed state before i)^T k_i) solves the unit
    lower-triangular system (I + A) delta = U - W S with A_ij = beta_i D_ij k_i.k_j (j < i),
    U = beta v, W = beta exp(G) k: the state S enters only through W S. Then
        o_i   = exp(G_i) S^T q_i + sum_{j<=i} D_ij (q_i.k_j) delta_j
        S_out = exp(G_L) S + sum_j exp(G_L - G_j) k_j delta_j^T.
    Exponents are differences G_i - G_j <= 0, masked to -inf above the diagonal before exp.

    Returns:
        o (L, H, V) and the state after the chunk (H, K, V), in the inputs' dtype.
    """
    length = g.shape[0]
    cum = torch.cumsum(g, dim=0).T  # (H, L)
    lower = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    decay = torch.exp((cum[:, :, None] - cum[:, None, :]).masked_fill(~lower, float("-inf")))  # (H, i, j)
    kh, qh, vh, bh = k.transpose(0, 1), q.transpose(0, 1), v.transpose(0, 1), beta.T  # heads first
    a = (bh[:, :, None] * decay * (kh @ kh.transpose(1, 2))).tril(-1)
    system = a + torch.eye(length, dtype=a.dtype, device=a.device)
    rhs = torch.cat([bh[..., None] * vh, (bh * cum.exp())[..., None] * kh], dim=-1)
    uw = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    delta = uw[..., : vh.shape[-1]] - uw[..., vh.shape[-1]:] @ state  # (H, L, V)
    o = cum.exp()[..., None] * (qh @ state) + (decay * (qh @ kh.transpose(1, 2))) @ delta
    to_end = torch.exp(cum[:, -1:] - cum)[..., None] * kh  # (H, L, K)
    final = cum[:, -1].exp()[:, None, None] * state + to_end.transpose(1, 2) @ delta
    return o.transpose(0, 1), final


def _check_varlen(cu_seqlens: Tensor, total: int) -> list[int]:
    bounds = cu_seqlens.tolist()
    if cu_seqlens.dim() != 1 or len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"cu_seqlens must be (N+1,) from 0 to the {total} packed tokens, got {bounds}")
    if any(hi <= lo for lo, hi in zip(bounds, bounds[1:], strict=False)):
        raise ValueError(f"every sequence needs at least one token, got cu_seqlens {bounds}")
    return bounds


def _varlen_inputs(k: Tensor, v: Tensor, cu_seqlens: Tensor, initial_state: Tensor | None,
                   state_indices: Tensor | None, capture_seqs: Tensor | None, capture_lens: Tensor | None,
                   cdt: torch.dtype) -> tuple[list[int], Tensor, list[tuple[int, int]]]:
    """Checked arguments of a varlen prefill: bounds (host list), initial states (N, Hv, K, V) in cdt,
    and the captures as (sequence, tokens) pairs."""
    bounds = _check_varlen(cu_seqlens, v.shape[0])
    num_seqs, (hv, dv), dk = len(bounds) - 1, v.shape[1:], k.shape[-1]
    if initial_state is None:
        starts = torch.zeros(num_seqs, hv, dk, dv, dtype=cdt, device=v.device)
    elif state_indices is None:
        starts = initial_state.to(cdt)
    else:
        starts = initial_state[state_indices.long()].to(cdt)
    if starts.shape != (num_seqs, hv, dk, dv):
        raise ValueError(f"initial states must be ({num_seqs}, {hv}, {dk}, {dv}), got {tuple(starts.shape)}")
    wanted = list(zip([] if capture_seqs is None else capture_seqs.tolist(),
                      [] if capture_lens is None else capture_lens.tolist(), strict=True))
    for seq, at in wanted:
        if not (0 <= seq < num_seqs and 0 <= at <= bounds[seq + 1] - bounds[seq]):
            raise ValueError(f"capture (sequence {seq}, after {at} tokens) is outside the batch's sequences")
    return bounds, starts, wanted


def gated_delta_chunk_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    cu_seqlens: Tensor,
    initial_state: Tensor | None = None,
    state_indices: Tensor | None = None,
    chunk_size: int = 64,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    capture_seqs: Tensor | None = None,
    capture_lens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Chunked prefill of N packed sequences (varlen), with boundary captures.

    Arguments:
        q, k: (T, Hk, K); v: (T, Hv, V); g, beta: (T, Hv); sequence n holds the packed rows
            cu_seqlens[n]:cu_seqlens[n+1].
        cu_seqlens: (N+1,) int64 from 0 to T, every sequence at least one token.
        initial_state: (N, Hv, K, V), or with ``state_indices`` a pool (S, Hv, K, V) read at rows
            state_indices (N,) (the pool is only read: the caller stores the final states), or None (zeros).
        chunk_size: tokens per chunk of the WY form.
        scale, use_qk_l2norm: as in ``gated_delta_recurrent_ref``.
        capture_seqs, capture_lens: (C,) int: capture c is the state after the first
            capture_lens[c] tokens (0 .. length) of sequence capture_seqs[c], for prefix caching.
            Chunks are cut at each capture, so a capture is a chunk's final state, never a replay.

    Returns:
        o (T, Hv, V) in v's dtype; final states (N, Hv, K, V) and captures (C, Hv, K, V) (C = 0
        when none are asked) in the compute dtype.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    qc, kc, vc, gc, bc = _prepare_qkv(q, k, v, g, beta, scale, use_qk_l2norm)
    cdt, (hv, dv), dk = vc.dtype, v.shape[1:], k.shape[-1]
    bounds, starts, wanted = _varlen_inputs(k, v, cu_seqlens, initial_state, state_indices, capture_seqs,
                                            capture_lens, cdt)
    o = torch.empty_like(vc)
    finals, states_at = [], {}
    for n in range(len(bounds) - 1):
        lo, hi = bounds[n], bounds[n + 1]
        cuts = sorted({*range(0, hi - lo, chunk_size), hi - lo, *(at for seq, at in wanted if seq == n)})
        state = starts[n]
        states_at[n, 0] = state
        for a, b in zip(cuts, cuts[1:], strict=False):
            o[lo + a: lo + b], state = wy_chunk_ref(state, *(t[lo + a: lo + b] for t in (qc, kc, vc, gc, bc)))
            states_at[n, b] = state
        finals.append(state)
    captured = (torch.stack([states_at[key] for key in wanted]) if wanted
                else torch.empty(0, hv, dk, dv, dtype=cdt, device=v.device))
    return o.to(v.dtype), torch.stack(finals), captured


def _pool_rows(state: Tensor, batch: int, state_indices: Tensor | None) -> list[tuple[int, int]]:
    """(row, slot) of every real row of a step on the pool `state`; -1 marks a padded row."""
    if state_indices is None:
        if state.shape[0] != batch:
            raise ValueError(f"state_indices=None needs S == B, got S={state.shape[0]}, B={batch}")
        return [(row, row) for row in range(batch)]
    if state_indices.shape != (batch,):
        raise ValueError(f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    rows = [(row, s) for row, s in enumerate(state_indices.tolist()) if s != -1]
    real = [s for _, s in rows]
    if any(not 0 <= s < state.shape[0] for s in real) or len(set(real)) != len(real):
        raise ValueError(f"state_indices must be distinct slots in [0, {state.shape[0]}) or -1, got {real}")
    return rows


def gated_delta_verify_ref(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    state_indices: Tensor | None = None, out_states: Tensor | None = None,
    scale: float | None = None, use_qk_l2norm: bool = False,
) -> Tensor:
    """T tokens per row from the pool's states; the pool is only read.

    Arguments:
        state: (S, Hv, K, V) state pool; row state_indices[b] is row b's state before its tokens.
        q, k: (B, T, Hk, K); v: (B, T, Hv, V); g, beta: (B, T, Hv).
        state_indices: (B,) int64 distinct slots, -1 = padded row (output zeros, nothing written),
            or None for arange(B) with S == B.
        out_states: (B, T, Hv, K, V) or None: if given, out_states[b, t] is set IN PLACE (in its
            dtype) to the state after token t of row b, so that keeping a tokens is the copy of
            out_states[b, a - 1] into the pool (``copy_rows``), as the Mamba2 baseline's spec_states.
        scale, use_qk_l2norm: as in ``gated_delta_recurrent_ref``.

    Returns:
        o: (B, T, Hv, V) in v's dtype, computed in compute_dtype(v.dtype).
    """
    o = torch.zeros_like(v)
    for row, slot in _pool_rows(state, v.shape[0], state_indices):
        current = state[slot : slot + 1]
        for t in range(v.shape[1]):
            out, current = gated_delta_recurrent_ref(*(x[row : row + 1, t : t + 1] for x in (q, k, v, g, beta)),
                                                     current, scale, use_qk_l2norm)
            o[row, t] = out[0, 0]
            if out_states is not None:
                out_states[row, t] = current[0].to(out_states.dtype)
    return o


def gated_delta_step_ref(
    state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
    state_indices: Tensor | None = None, scale: float | None = None, use_qk_l2norm: bool = False,
) -> Tensor:
    """One decode token per row; the pool rows state_indices are updated IN PLACE.

    Arguments:
        state: (S, Hv, K, V) state pool, written back in its dtype; other rows untouched.
        q, k: (B, Hk, K); v: (B, Hv, V); g, beta: (B, Hv).
        state_indices: (B,) int64 distinct slots, -1 = padded row (output zeros, state untouched),
            or None for arange(B) with S == B.
        scale, use_qk_l2norm: as in ``gated_delta_recurrent_ref``.

    Returns:
        o: (B, Hv, V) in v's dtype, computed in compute_dtype(v.dtype).
    """
    after = torch.empty(v.shape[0], 1, *state.shape[1:], dtype=state.dtype, device=state.device)
    o = gated_delta_verify_ref(state, *(x[:, None] for x in (q, k, v, g, beta)), state_indices, after,
                               scale, use_qk_l2norm)
    for row, slot in _pool_rows(state, v.shape[0], state_indices):
        state[slot] = after[row, 0]
    return o[:, 0]


def gated_delta_step(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                     state_indices: Tensor | None = None, scale: float | None = None,
                     use_qk_l2norm: bool = False) -> Tensor:
    """``gated_delta_step_ref``, by its kernel where it serves the pool `state`."""
    if use_triton(state, None):
        from replayserve.ops.gated_delta_triton import gated_delta_step_triton

        return gated_delta_step_triton(state, q, k, v, g, beta, state_indices, scale, use_qk_l2norm)
    return gated_delta_step_ref(state, q, k, v, g, beta, state_indices, scale, use_qk_l2norm)


def gated_delta_verify(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                       state_indices: Tensor | None = None, out_states: Tensor | None = None,
                       scale: float | None = None, use_qk_l2norm: bool = False) -> Tensor:
    """``gated_delta_verify_ref``, by its kernel where it serves the pool `state`."""
    if use_triton(state, None):
        from replayserve.ops.gated_delta_triton import gated_delta_verify_triton

        return gated_delta_verify_triton(state, q, k, v, g, beta, state_indices, out_states, scale, use_qk_l2norm)
    return gated_delta_verify_ref(state, q, k, v, g, beta, state_indices, out_states, scale, use_qk_l2norm)


def chunk_gated_delta(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, cu_seqlens: Tensor,
    initial_state: Tensor | None = None, state_indices: Tensor | None = None, chunk_size: int = 64,
    scale: float | None = None, use_qk_l2norm: bool = False,
    capture_seqs: Tensor | None = None, capture_lens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``gated_delta_chunk_ref`` (same arguments, shapes and returns), by flash-linear-attention's
    ``chunk_gated_delta_rule`` where it serves: inputs on CUDA in a kernel dtype and fla-core installed
    (``gated_delta_fla``: states in fp32, chunk_size 16, 32 or 64, captures by cuts). fla's autotuned
    kernels need a GPU, so ``force_triton`` does not send a CPU call there."""
    if v.is_cuda and use_triton(v):
        from replayserve.ops.gated_delta_fla import chunk_by_segments, fla_chunk_rule, fla_runner

        if fla_chunk_rule() is not None:
            bounds, starts, wanted = _varlen_inputs(k, v, cu_seqlens, initial_state, state_indices, capture_seqs,
                                                    capture_lens, torch.float32)
            return chunk_by_segments(fla_runner(scale, use_qk_l2norm, chunk_size), q, k, v, g, beta, bounds, starts,
                                     wanted)
    return gated_delta_chunk_ref(q, k, v, g, beta, cu_seqlens, initial_state, state_indices, chunk_size, scale,
                                 use_qk_l2norm, capture_seqs, capture_lens)
