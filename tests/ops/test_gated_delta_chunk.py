"""The chunked (WY) varlen prefill against the token-by-token recurrence, in float64."""

import pytest
import torch

from replayserve.ops.gated_delta import gated_delta_chunk_ref, gated_delta_recurrent_ref


def _packed(lengths, hk=2, hv=4, dk=8, dv=6, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(total, hk, dk, generator=gen, dtype=dtype) for _ in range(2))
    v = torch.randn(total, hv, dv, generator=gen, dtype=dtype)
    g = -torch.rand(total, hv, generator=gen, dtype=dtype)
    beta = torch.rand(total, hv, generator=gen, dtype=dtype)
    s0 = torch.randn(len(lengths), hv, dk, dv, generator=gen, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return q, k, v, g, beta, s0, cu


def _recurrent_per_sequence(q, k, v, g, beta, s0, cu, **kw):
    """Each sequence alone through the recurrence; the states after every token too."""
    outs, states = [], []
    for n in range(len(cu) - 1):
        lo, hi = cu[n].item(), cu[n + 1].item()
        state, after = s0[n : n + 1], [s0[n]]
        for t in range(lo, hi):
            o, state = gated_delta_recurrent_ref(*(x[None, t : t + 1] for x in (q, k, v, g, beta)), state, **kw)
            outs.append(o[0, 0])
            after.append(state[0])
        states.append(after)
    return torch.stack(outs), states


@pytest.mark.parametrize("chunk_size", [4, 64])
@pytest.mark.parametrize("l2norm", [False, True])
def test_varlen_equals_recurrence_with_captures(chunk_size, l2norm):
    lengths = [1, 9, 4, 13, 1, 8, 30, 2]
    q, k, v, g, beta, s0, cu = _packed(lengths)
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(0, len(lengths), (12,), generator=gen)
    lens = torch.stack([torch.randint(0, lengths[s] + 1, (1,), generator=gen)[0] for s in seqs.tolist()])
    o, final, captured = gated_delta_chunk_ref(q, k, v, g, beta, cu, s0, chunk_size=chunk_size,
                                               use_qk_l2norm=l2norm, capture_seqs=seqs, capture_lens=lens)
    o_ref, states = _recurrent_per_sequence(q, k, v, g, beta, s0, cu, use_qk_l2norm=l2norm)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, torch.stack([s[-1] for s in states]), rtol=0, atol=1e-12)
    expect = torch.stack([states[s][at] for s, at in zip(seqs.tolist(), lens.tolist(), strict=True)])
    torch.testing.assert_close(captured, expect, rtol=0, atol=1e-12)


def test_many_sequences_from_a_state_pool_and_zero_start():
    lengths = torch.randint(1, 20, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    q, k, v, g, beta, s0, cu = _packed(lengths, hk=1, hv=3, seed=3)
    pool = torch.randn(50, *s0.shape[1:], dtype=s0.dtype)
    slots = torch.randperm(50)[:40]
    o, final, captured = gated_delta_chunk_ref(q, k, v, g, beta, cu, pool, state_indices=slots, chunk_size=8)
    o_ref, states = _recurrent_per_sequence(q, k, v, g, beta, pool[slots], cu)
    torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(final, torch.stack([s[-1] for s in states]), rtol=0, atol=1e-12)
    assert captured.shape == (0, 3, 8, 6)
    o0, final0, _ = gated_delta_chunk_ref(q, k, v, g, beta, cu, chunk_size=16)
    o0_ref, states0 = _recurrent_per_sequence(q, k, v, g, beta, torch.zeros_like(s0), cu)
    torch.testing.assert_close(o0, o0_ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(final0, torch.stack([s[-1] for s in states0]), rtol=0, atol=1e-12)


def test_half_precision_computes_in_float32():
    q, k, v, g, beta, s0, cu = _packed([5, 70], dtype=torch.bfloat16)
    o, final, _ = gated_delta_chunk_ref(q, k, v, g, beta, cu, s0, use_qk_l2norm=True)
    o_ref, states = _recurrent_per_sequence(*(x.double() for x in (q, k, v, g, beta, s0)), cu, use_qk_l2norm=True)
    assert o.dtype == torch.bfloat16 and final.dtype == torch.float32
    torch.testing.assert_close(o.double(), o_ref, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(final.double(), torch.stack([s[-1] for s in states]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("cu", [[0, 3, 3, 5], [1, 5], [0, 4]])
def test_bad_cu_seqlens_are_refused(cu):
    q, k, v, g, beta, s0, _ = _packed([5])
    with pytest.raises(ValueError, match="cu_seqlens"):
        gated_delta_chunk_ref(q, k, v, g, beta, torch.tensor(cu))
