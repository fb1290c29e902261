"""Depthwise causal conv1d used by the Mamba2 mixer (prefill and decode): the references, and the
decode and verify steps' entry points, which run the kernels of ``conv1d_triton`` where they serve
(``dispatch.use_triton``: one launch each, padded rows skipped)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops.conv1d_checks import check_activation, check_pool
from replayserve.ops.dispatch import use_triton
from replayserve.ops.dtypes import compute_dtype


def _apply_taps(taps: list[Tensor], weight: Tensor, bias: Tensor | None, activation: str | None) -> Tensor:
    # Prefill and decode both go through this tap-by-tap elementwise sum so that
    # they perform the identical sequence of floating-point operations; a fused
    # reduction could pick a different summation order depending on shape.
    acc = taps[0] * weight[:, 0]
    for k in range(1, len(taps)):
        acc = acc + taps[k] * weight[:, k]
    if bias is not None:
        acc = acc + bias
    if activation == "silu":
        acc = F.silu(acc)
    return acc


def causal_conv1d_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv1d over one sequence, token-major.

    Arguments:
        x: (L, D) the tokens of one sequence, any float dtype.
        weight: (D, K) depthwise kernel (HF ``conv1d.weight`` squeezed).
        bias: (D,) or None.
        conv_state: (D, K-1) the K-1 inputs preceding ``x``; None means zeros
            (start of sequence).
        activation: "silu" or None.

    Returns:
        y: (L, D) in x.dtype, y[t, d] = act(bias[d] + sum_k weight[d, k] * u[t + k, d])
            with u = [conv_state.T ; x] of shape (L + K - 1, D), so the last tap
            multiplies the current token. Computed in compute_dtype(x.dtype).
        final_state: (D, K-1) in x.dtype, the last K-1 rows of u transposed;
            valid also when L < K - 1 (part of it then comes from conv_state).
    """
    check_activation(activation)
    seqlen, dim = x.shape
    if weight.shape[0] != dim:
        raise ValueError(f"weight has {weight.shape[0]} channels, x has {dim}")
    width = weight.shape[1]
    if conv_state is None:
        prev = x.new_zeros((width - 1, dim))
    else:
        if conv_state.shape != (dim, width - 1):
            raise ValueError(f"conv_state must be {(dim, width - 1)}, got {tuple(conv_state.shape)}")
        prev = conv_state.to(x.dtype).T
    u = torch.cat([prev, x], dim=0)

    cdt = compute_dtype(x.dtype)
    uc = u.to(cdt)
    taps = [uc[k : k + seqlen] for k in range(width)]
    bias_c = None if bias is None else bias.to(cdt)
    y = _apply_taps(taps, weight.to(cdt), bias_c, activation)
    final_state = u[seqlen:].T.contiguous()
    return y.to(x.dtype), final_state


def causal_conv1d_update_ref(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state_indices: Tensor,
    activation: str | None = "silu",
) -> Tensor:
    """One decode step of the causal conv1d for a batch of sequences.

    Arguments:
        x: (B, D) one new token per row.
        conv_state: (S, D, K-1) pool of state slots; rows ``state_indices`` are
            updated IN PLACE (shifted left by one with x appended), all other
            rows are left untouched. Indices must be distinct.
        weight: (D, K) depthwise kernel.
        bias: (D,) or None.
        state_indices: (B,) int64, the slot of each row of x.
        activation: "silu" or None.

    Returns:
        y: (B, D) in x.dtype; equals causal_conv1d_ref on the same token given
            the same state (identical operation order).
    """
    check_activation(activation)
    batch, dim = x.shape
    width = weight.shape[1]
    check_pool(conv_state, state_indices, batch, dim, width)
    idx = state_indices.long()
    # Cast the stored state to x.dtype first so decode sees exactly the values
    # prefill would have seen in u.
    window = torch.cat([conv_state[idx].to(x.dtype), x.unsqueeze(-1)], dim=-1)  # (B, D, K)

    cdt = compute_dtype(x.dtype)
    wc = window.to(cdt)
    taps = [wc[..., k] for k in range(width)]
    bias_c = None if bias is None else bias.to(cdt)
    y = _apply_taps(taps, weight.to(cdt), bias_c, activation)
    conv_state[idx] = window[..., 1:].to(conv_state.dtype)
    return y.to(x.dtype)


def causal_conv1d_verify_ref(
    x: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    state_indices: Tensor,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """Up to T tokens per row (a speculative verify), leaving the conv state untouched.

    Arguments:
        x: (B, T, D) the rows' tokens, padded to T.
        conv_state, weight, bias, state_indices, activation: as in ``causal_conv1d_update_ref``.

    Returns:
        y: (B, T, D) in x.dtype, token t of row b as ``causal_conv1d_update_ref`` would give it
            after tokens 0..t-1 (identical operation order).
        window: (B, D, K-1+T) in x.dtype, the stored inputs then the new ones: the conv state
            after the first j tokens of row b is ``window[b, :, j : j + K - 1]``.
    """
    check_activation(activation)
    batch, tokens, dim = x.shape
    width = weight.shape[1]
    check_pool(conv_state, state_indices, batch, dim, width)
    window = torch.cat([conv_state[state_indices.long()].to(x.dtype), x.transpose(1, 2)], dim=-1)
    cdt = compute_dtype(x.dtype)
    wc = window.to(cdt)
    taps = [wc[..., k : k + tokens].transpose(1, 2) for k in range(width)]  # (B, T, D) each
    bias_c = None if bias is None else bias.to(cdt)
    y = _apply_taps(taps, weight.to(cdt), bias_c, activation)
    return y.to(x.dtype), window



def causal_conv1d_update(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                         state_indices: Tensor) -> Tensor:
    """``causal_conv1d_update_ref`` with silu, by its kernel where it serves the pool `conv_state`."""
    if use_triton(conv_state):
        from replayserve.ops.conv1d_triton import causal_conv1d_update_triton

        return causal_conv1d_update_triton(x, conv_state, weight, bias, state_indices)
    return causal_conv1d_update_ref(x, conv_state, weight, bias, state_indices)


def causal_conv1d_verify(x: Tensor, conv_state: Tensor, weight: Tensor, bias: Tensor | None,
                         state_indices: Tensor) -> tuple[Tensor, Tensor]:
    """``causal_conv1d_verify_ref`` with silu, by its kernel where it serves the pool `conv_state`."""
    if use_triton(conv_state):
        from replayserve.ops.conv1d_triton import causal_conv1d_verify_triton

        return causal_conv1d_verify_triton(x, conv_state, weight, bias, state_indices)
    return causal_conv1d_verify_ref(x, conv_state, weight, bias, state_indices)

def causal_conv1d_varlen_ref(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    conv_state: Tensor,
    state_slots: Tensor,
    cu_seqlens: Tensor,
    activation: str | None = "silu",
    captures: tuple[Tensor, Tensor, Tensor] | None = None,
    end_slots: Tensor | None = None,
) -> Tensor:
    """``causal_conv1d_ref`` over S packed sequences, each from and back into its conv state slot.

    Arguments:
        x: (T, D) the tokens of all sequences, sequence s at rows cu_seqlens[s]:cu_seqlens[s+1].
        weight: (D, K); bias: (D,) or None; activation: "silu" or None.
        conv_state: (slots, D, K-1) pool; row state_slots[s] holds the K-1 inputs before sequence s
            and is overwritten IN PLACE with the K-1 inputs ending at its last token (unchanged
            inputs shift in when the sequence is shorter than K-1).
        state_slots: (S,) int, distinct.
        cu_seqlens: (S+1,) int, ascending from 0 to T.
        captures: (sequence, end token, slot), (M,) int each, or None: the conv state before packed
            token `end` of that sequence is written into the slot (prefix caching's boundaries).
        end_slots: (S,) int or None: a slot that also receives sequence s's final conv state (-1:
            none). Capture and end slots differ from state_slots and from each other.

    Returns:
        y: (T, D) in x.dtype.
    """
    bounds, slots = cu_seqlens.tolist(), state_slots.tolist()
    if len(bounds) != len(slots) + 1:
        raise ValueError(f"cu_seqlens must be (S+1,) for S={len(slots)} state slots, got {len(bounds)} entries")
    width = conv_state.shape[-1]
    # Captures read the stored states before any sequence overwrites its slot.
    windows = [(dst, torch.cat([conv_state[slots[s]].to(x.dtype), x[bounds[s] : end].T], dim=1)[:, -width:])
               for s, end, dst in zip(*(t.tolist() for t in captures), strict=True)] if captures is not None else []
    for dst, window in windows:
        conv_state[dst] = window.to(conv_state.dtype)
    ys = []
    for s, slot in enumerate(slots):
        y, conv_state[slot] = causal_conv1d_ref(x[bounds[s] : bounds[s + 1]], weight, bias, conv_state[slot],
                                                activation)
        if end_slots is not None and (dst := int(end_slots[s])) >= 0:
            conv_state[dst] = conv_state[slot]
        ys.append(y)
    return torch.cat(ys)


def causal_conv1d_varlen(x: Tensor, weight: Tensor, bias: Tensor | None, conv_state: Tensor, state_slots: Tensor,
                         cu_seqlens: Tensor, captures: tuple[Tensor, Tensor, Tensor] | None = None,
                         end_slots: Tensor | None = None) -> Tensor:
    """``causal_conv1d_varlen_ref`` with silu, by its kernel where it serves the pool `conv_state`."""
    if use_triton(conv_state):
        from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton

        return causal_conv1d_varlen_triton(x, weight, bias, conv_state, state_slots, cu_seqlens,
                                           captures=captures, end_slots=end_slots)
    return causal_conv1d_varlen_ref(x, weight, bias, conv_state, state_slots, cu_seqlens, captures=captures,
                                    end_slots=end_slots)
