"""Triton gated delta rule decode and verify steps (baseline): match ``gated_delta_step_ref`` and
``gated_delta_verify_ref`` of ``replayserve.ops.gated_delta``.

One program per (V-block, value head, row) holds its (K, BLOCK_V) state tile in registers for all
of the row's tokens: the delta rule's read S^T k is a sum over K within each value column, so
V-blocks never exchange anything. Per token, in fp32:

    S <- exp(g) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q

The decode step writes the tile back in place (the state is read and written once per token: 8
bytes per fp32 state element, memory bound at serving batch sizes); the verify form leaves the
pool alone and stores the tile after every token into ``out_states``: T state writes per row,
which is what makes ReplaySSM's verify (``replay_gdn``: no state write at all) the cheaper one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _gated_delta_kernel(
    state_ptr, idx_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr, out_ptr,
    scale, num_tokens, dk, dv, heads_per_key,
    s_st_slot, s_st_h, s_st_k, s_st_v,
    s_q_b, s_q_t, s_q_h, s_q_k,
    s_k_b, s_k_t, s_k_h, s_k_k,
    s_v_b, s_v_t, s_v_h, s_v_v,
    s_g_b, s_g_t, s_g_h,
    s_be_b, s_be_t, s_be_h,
    s_o_b, s_o_t, s_o_h, s_o_v,
    s_out_b, s_out_t, s_out_h, s_out_k, s_out_v,
    HAS_INDICES: tl.constexpr, L2NORM: tl.constexpr, WRITE_POOL: tl.constexpr, KEEP_STATES: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < dk
    mask_v = offs_v < dv
    mask_kv = mask_k[:, None] & mask_v[None, :]
    if HAS_INDICES:
        slot = tl.load(idx_ptr + row).to(tl.int64)
    else:
        slot = row.to(tl.int64)
    o_ptrs = o_ptr + row * s_o_b + h * s_o_h + offs_v * s_o_v
    if slot < 0:  # padded row: no state access, zero outputs
        for t in range(num_tokens):
            tl.store(o_ptrs + t * s_o_t, tl.zeros([BLOCK_V], dtype=tl.float32).to(o_ptr.dtype.element_ty),
                     mask=mask_v)
        return
    hk = h // heads_per_key
    st_ptrs = state_ptr + slot * s_st_slot + h * s_st_h + offs_k[:, None] * s_st_k + offs_v[None, :] * s_st_v
    s = tl.load(st_ptrs, mask=mask_kv, other=0.0).to(tl.float32)
    for t in range(num_tokens):
        q = tl.load(q_ptr + row * s_q_b + t * s_q_t + hk * s_q_h + offs_k * s_q_k, mask=mask_k, other=0.0)
        k = tl.load(k_ptr + row * s_k_b + t * s_k_t + hk * s_k_h + offs_k * s_k_k, mask=mask_k, other=0.0)
        q, k = q.to(tl.float32), k.to(tl.float32)
        if L2NORM:  # as l2norm_ref: x / sqrt(sum(x^2) + 1e-6)
            q = q / tl.sqrt(tl.sum(q * q) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k) + 1e-6)
        q = q * scale
        v = tl.load(v_ptr + row * s_v_b + t * s_v_t + h * s_v_h + offs_v * s_v_v, mask=mask_v, other=0.0)
        g = tl.load(g_ptr + row * s_g_b + t * s_g_t + h * s_g_h).to(tl.float32)
        beta = tl.load(beta_ptr + row * s_be_b + t * s_be_t + h * s_be_h).to(tl.float32)
        s = s * tl.exp(g)
        delta = (v.to(tl.float32) - tl.sum(s * k[:, None], axis=0)) * beta
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(o_ptrs + t * s_o_t, o.to(o_ptr.dtype.element_ty), mask=mask_v)
        if KEEP_STATES:
            out_ptrs = (out_ptr + row * s_out_b + t * s_out_t + h * s_out_h
                        + offs_k[:, None] * s_out_k + offs_v[None, :] * s_out_v)
            tl.store(out_ptrs, s.to(out_ptr.dtype.element_ty), mask=mask_kv)
    if WRITE_POOL:
        tl.store(st_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_kv)


def _block_v(dk: int, dv: int) -> int:
    """About 4K state elements per program (32 per thread at 4 warps). Not tuned on a GPU yet."""
    return max(1, min(triton.next_power_of_2(dv), 4096 // triton.next_power_of_2(dk)))


def _launch(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_indices: Tensor | None,
            out_states: Tensor | None, scale: float | None, use_qk_l2norm: bool, write_pool: bool) -> Tensor:
    """Run the kernel on (B, T, ...) inputs; returns o (B, T, Hv, V)."""
    batch, tokens, hv, dv = v.shape
    hk, dk = k.shape[2:]
    if q.shape != k.shape or k.shape[:2] != (batch, tokens) or hv % hk:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} must be (B, T, Hk, K) with Hv={hv} a multiple of Hk")
    if g.shape != (batch, tokens, hv) or beta.shape != g.shape:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be ({batch}, {tokens}, {hv})")
    if state.shape[1:] != (hv, dk, dv):
        raise ValueError(f"state {tuple(state.shape)} must be (S, {hv}, {dk}, {dv})")
    if state_indices is None and state.shape[0] != batch:
        raise ValueError(f"state_indices=None needs S == B, got S={state.shape[0]}, B={batch}")
    if state_indices is not None and state_indices.shape != (batch,):
        raise ValueError(f"state_indices must be ({batch},), got {tuple(state_indices.shape)}")
    if out_states is not None and out_states.shape != (batch, tokens, hv, dk, dv):
        raise ValueError(f"out_states must be ({batch}, {tokens}, {hv}, {dk}, {dv}), got {tuple(out_states.shape)}")
    o = torch.empty_like(v)
    if batch == 0:
        return o
    block_v = _block_v(dk, dv)
    keep = out_states is not None
    _gated_delta_kernel[(triton.cdiv(dv, block_v), hv, batch)](
        state, state_indices, q, k, v, g, beta, o, out_states,
        dk ** -0.5 if scale is None else scale, tokens, dk, dv, hv // hk,
        *state.stride(), *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *o.stride(),
        *(out_states.stride() if keep else (0,) * 5),
        HAS_INDICES=state_indices is not None, L2NORM=use_qk_l2norm, WRITE_POOL=write_pool, KEEP_STATES=keep,
        BLOCK_K=triton.next_power_of_2(dk), BLOCK_V=block_v, num_warps=4,
    )
    return o


def gated_delta_step_triton(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                            state_indices: Tensor | None = None, scale: float | None = None,
                            use_qk_l2norm: bool = False) -> Tensor:
    """One decode token per row, on GPU (or the Triton interpreter); shapes as ``gated_delta_step_ref``.

    state: (S, Hv, K, V) pool (fp32, bf16 or fp16, any strides), rows state_indices updated IN PLACE;
    q, k (B, Hk, K), v (B, Hv, V), g, beta (B, Hv); state_indices (B,) int64, -1 = padded row.
    Returns o (B, Hv, V) in v's dtype, computed in fp32.
    """
    o = _launch(state, *(x[:, None] for x in (q, k, v, g, beta)), state_indices, None, scale, use_qk_l2norm, True)
    return o[:, 0]


def gated_delta_verify_triton(state: Tensor, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
                              state_indices: Tensor | None = None, out_states: Tensor | None = None,
                              scale: float | None = None, use_qk_l2norm: bool = False) -> Tensor:
    """T tokens per row, the pool only read; shapes as ``gated_delta_verify_ref``.

    q, k (B, T, Hk, K), v (B, T, Hv, V), g, beta (B, T, Hv); out_states (B, T, Hv, K, V) or None,
    written IN PLACE with the state after each token. Returns o (B, T, Hv, V) in v's dtype.
    """
    return _launch(state, q, k, v, g, beta, state_indices, out_states, scale, use_qk_l2norm, False)
