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
"""

from __future__ import annotations

import torch
from torch import Tensor

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
    out_dtype, cdt = v.dtype, compute_dtype(v.dtype)
    hv, dk = v.shape[-2], k.shape[-1]
    q, k = (expand_key_heads(t, hv).to(cdt) for t in (q, k))
    v, g, beta = v.to(cdt), g.to(cdt), beta.to(cdt)
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q = q * (dk ** -0.5 if scale is None else scale)
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
