"""ReplaySSM for Gated DeltaNet: the references against the token-by-token recurrence (float64 oracle)."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.gated_delta import expand_key_heads, gated_delta_recurrent_ref, gated_delta_step_ref, l2norm_ref
from replayserve.ops.replay_gdn import replay_gdn_materialize_ref, replay_gdn_step_ref
from replayserve.ops.replay_ssm import replay_commit_ref, replay_prepare_ref, ring_index

F64 = torch.float64
TOL = 1e-10
I32 = torch.int32


def make_pool(slots: int, hk: int, hv: int, dk: int, dv: int, ring_len: int, gen: torch.Generator) -> list:
    """[state, k_ring, delta_ring, g_ring, ring_start, history, is_flush]; rings hold garbage
    on purpose: nothing past `history` may ever be read."""
    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=F64)

    cursors = [torch.zeros(slots, dtype=I32), torch.zeros(slots, dtype=I32), torch.zeros(slots, dtype=torch.bool)]
    return [randn(slots, hv, dk, dv), randn(slots, hk, ring_len, dk), randn(slots, hv, ring_len, dv),
            randn(slots, hv, ring_len), *cursors]


def tokens(gen: torch.Generator, rows: int, t: int, hk: int, hv: int, dk: int, dv: int) -> list[torch.Tensor]:
    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=F64)

    return [randn(rows, t, hk, dk), randn(rows, t, hk, dk), randn(rows, t, hv, dv),
            -torch.rand(rows, t, hv, generator=gen, dtype=F64), torch.rand(rows, t, hv, generator=gen, dtype=F64)]


def corrections(state: torch.Tensor, kept: list, l2norm: bool) -> torch.Tensor:
    """delta_j = beta_j (v_j - (exp(g_j) S_{j-1})^T k_j) of each kept token, by the plain recurrence
    from `state` (Hv, K, V); kept: per token (k (Hk, K), v (Hv, V), g (Hv,), beta (Hv,)). -> (L, Hv, V)."""
    out = []
    for k, v, g, beta in kept:
        k = expand_key_heads(k, v.shape[0])
        k = l2norm_ref(k) if l2norm else k
        state = torch.exp(g)[:, None, None] * state
        delta = beta[:, None] * (v - torch.einsum("hkv,hk->hv", state, k))
        state = state + k[:, :, None] * delta[:, None, :]
        out.append(delta)
    return torch.stack(out)


def drive(seed: int, window: int, t: int, steps: int, l2norm: bool, shape=(1, 2, 8, 4), num_slots: int = 6,
          rows: int = 4, pad: bool = True, materialize_every: int = 1):
    """Random verify steps with random acceptance (rollback) and padded rows; after every step the
    outputs equal the recurrence from the canonical state and materialization gives that state."""
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    ring_len = window + t
    pool = make_pool(num_slots + 1, hk, hv, dk, dv, ring_len, gen)  # the last slot is a scratch boundary slot
    state, *rings = pool[:4]
    cursors = pool[4:]
    canonical = state[:num_slots].clone()
    initial, kept = state[:num_slots].clone(), [[] for _ in range(num_slots)]  # every slot's kept tokens
    flushes = 0
    for step in range(steps):
        slots = torch.randperm(num_slots, generator=gen)[:rows]
        if pad and step % 3 == 1:
            slots[0] = -1
        n = torch.randint(1, t + 1, (rows,), generator=gen)
        q, k, v, g, beta = tokens(gen, rows, t, hk, hv, dk, dv)
        replay_prepare_ref(*cursors, slots, n, torch.zeros(rows, dtype=torch.bool), window)
        flushes += int(cursors[2][slots[slots >= 0]].sum())
        o = replay_gdn_step_ref(state, *rings, *cursors, slots, n, q, k, v, g, beta, use_qk_l2norm=l2norm)
        accepted = torch.zeros(rows, dtype=torch.long)
        for row, s in enumerate(slots.tolist()):
            if s == -1:
                assert not o[row].any()
                continue
            m = n[row].item()
            o_ref, _ = gated_delta_recurrent_ref(*(x[row : row + 1, :m] for x in (q, k, v, g, beta)),
                                                 canonical[s : s + 1], use_qk_l2norm=l2norm)
            torch.testing.assert_close(o[row, :m], o_ref[0], rtol=TOL, atol=TOL)
            assert not o[row, m:].any(), "positions past n give zeros"
            a = torch.randint(1, m + 1, (1,), generator=gen).item()
            accepted[row] = a
            kept[s] += [(k[row, i], v[row, i], g[row, i], beta[row, i]) for i in range(a)]
            _, canonical[s : s + 1] = gated_delta_recurrent_ref(*(x[row : row + 1, :a] for x in (q, k, v, g, beta)),
                                                                canonical[s : s + 1], use_qk_l2norm=l2norm)
        replay_commit_ref(*cursors, slots, accepted, ring_len)
        for s in range(num_slots):  # the stored corrections stay the recurrence's through flushes and rollbacks
            m, start = int(cursors[1][s]), int(cursors[0][s])
            if m:
                idx = [ring_index(start, j, ring_len) for j in range(m)]
                stored = rings[1][s][:, idx].transpose(0, 1)
                expected = corrections(initial[s], kept[s], l2norm)[-m:]
                torch.testing.assert_close(stored, expected, rtol=TOL, atol=TOL)
        if step % materialize_every == 0:
            scratch = torch.tensor([num_slots])
            for s in range(num_slots):
                src_state = state[s].clone()
                replay_gdn_materialize_ref(state, *rings, torch.tensor([s]), scratch, cursors[0][s : s + 1].clone(),
                                           cursors[1][s : s + 1].clone(), use_qk_l2norm=l2norm)
                torch.testing.assert_close(state[num_slots], canonical[s], rtol=TOL, atol=TOL)
                assert torch.equal(state[s], src_state), "materialization only reads its source"
    return flushes


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize(("window", "t"), [(4, 3), (3, 1), (8, 2)])
def test_verify_steps_with_rollback_equal_the_recurrence(window, t, l2norm):
    flushes = drive(seed=window * 10 + t, window=window, t=t, steps=14, l2norm=l2norm)
    assert flushes > 0, "the drive must cross flushes"


def test_gqa_heads_and_a_long_window():
    assert drive(seed=5, window=16, t=4, steps=20, l2norm=True, shape=(2, 4, 8, 8), materialize_every=5) > 0


def test_plain_decode_is_the_baseline_step():
    """T = 1, n = a = 1 every step: the outputs and the materialized states are the baseline's."""
    gen = torch.Generator().manual_seed(7)
    window, slots_n, shape = 3, 3, (1, 2, 4, 4)
    pool = make_pool(slots_n, *shape, window + 1, gen)
    state, *rings = pool[:4]
    cursors = pool[4:]
    baseline = state.clone()
    slots, ones = torch.arange(slots_n), torch.ones(slots_n, dtype=torch.long)
    for _ in range(10):
        q, k, v, g, beta = (x[:, 0] for x in tokens(gen, slots_n, 1, *shape))
        replay_prepare_ref(*cursors, slots, ones, torch.zeros(slots_n, dtype=torch.bool), window)
        o = replay_gdn_step_ref(state, *rings, *cursors, slots, ones, *(x[:, None] for x in (q, k, v, g, beta)))
        o_base = gated_delta_step_ref(baseline, q, k, v, g, beta, slots)
        torch.testing.assert_close(o[:, 0], o_base, rtol=TOL, atol=TOL)
        replay_commit_ref(*cursors, slots, ones, window + 1)
    out = state.clone()
    replay_gdn_materialize_ref(out, *rings, slots, slots, cursors[0].clone(), cursors[1].clone())
    torch.testing.assert_close(out, baseline, rtol=TOL, atol=TOL)


def test_materialize_with_no_entries_is_a_bitwise_copy_and_skips_padding():
    gen = torch.Generator().manual_seed(8)
    state, *rings = make_pool(4, 1, 1, 4, 4, 5, gen)[:4]
    before = state.clone()
    replay_gdn_materialize_ref(state, *rings, torch.tensor([0, -1, 1]), torch.tensor([2, 3, -1]),
                               torch.tensor([3, 0, 0], dtype=I32), torch.zeros(3, dtype=I32))
    assert torch.equal(state[2], before[0]) and torch.equal(state[[0, 1, 3]], before[[0, 1, 3]])


def test_shape_and_cursor_errors_name_the_problem():
    gen = torch.Generator().manual_seed(9)
    pool = make_pool(2, 1, 1, 4, 4, 5, gen)
    q, k, v, g, beta = tokens(gen, 1, 6, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="W \\+ T"):
        replay_gdn_step_ref(*pool, torch.tensor([0]), torch.tensor([1]), q, k, v, g, beta)
    pool[5][0] = 4  # history past W = R - T = 3
    q, k, v, g, beta = tokens(gen, 1, 2, 1, 1, 4, 4)
    with pytest.raises(ValueError, match="history=4"):
        replay_gdn_step_ref(*pool, torch.tensor([0]), torch.tensor([1]), q, k, v, g, beta)
