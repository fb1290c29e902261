"""The gated delta rule's reference against Hugging Face's own torch fallback (Qwen3-Next) and
against the closed form of its affine recurrence."""

import pytest
import torch

from replayserve.ops.gated_delta import gated_delta_recurrent_ref


def _inputs(b=2, t=7, hk=2, hv=4, dk=8, dv=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(b, t, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(b, t, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(b, t, hv, generator=gen, dtype=dtype)
    beta = torch.rand(b, t, hv, generator=gen, dtype=dtype)
    s0 = torch.randn(b, hv, dk, dv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, s0


def test_matches_transformers_recurrent_fallback():
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    q, k, v, g, beta, s0 = _inputs(dtype=torch.float32)
    o, s = gated_delta_recurrent_ref(q, k, v, g, beta, s0, use_qk_l2norm=True)
    # Where fla is importable, transformers' decorator serves fla's kernel under the torch name;
    # __wrapped__ is its own torch fallback either way.
    fallback = modeling.torch_recurrent_gated_delta_rule.__wrapped__
    # Key heads expanded here (each serving Hv // Hk value heads): transformers before 5.24 takes
    # equal head counts only. The GQA layout is held to transformers' by tests/models/test_qwen_parity.py.
    hv = v.shape[2]
    q_hf, k_hf = (t.repeat_interleave(hv // t.shape[2], dim=2) for t in (q, k))
    o_hf, s_hf = fallback(q_hf, k_hf, v, g, beta, initial_state=s0, output_final_state=True,
                          use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s, s_hf, rtol=1e-5, atol=1e-5)


def test_state_is_the_affine_recurrence_in_float64():
    """S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, built as explicit matrices."""
    q, k, v, g, beta, s0 = _inputs(hk=4)
    o, s = gated_delta_recurrent_ref(q, k, v, g, beta, s0, scale=1.0)
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    state = s0.clone()
    for t in range(v.shape[1]):
        kt = k[:, t]
        rank1 = beta[:, t][..., None, None] * kt[..., :, None] * kt[..., None, :]
        transition = g[:, t].exp()[..., None, None] * (eye - rank1)
        state = transition @ state + beta[:, t][..., None, None] * kt[..., :, None] * v[:, t][..., None, :]
        torch.testing.assert_close(o[:, t], (q[:, t][..., None, :] @ state).squeeze(-2), rtol=0, atol=1e-12)
    torch.testing.assert_close(s, state, rtol=0, atol=1e-12)
