"""Triton ReplaySSM-GDN kernels against the float64 references, over random verify/rollback drives
that cross flushes and wrap the ring, with padded rows and materializations."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops import replay_gdn as ref
from replayserve.ops import replay_gdn_triton as tk
from replayserve.ops.replay_ssm import replay_commit_ref, replay_prepare_ref

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TOL = (2e-4, 2e-4)  # (rtol, atol) of the fp32 kernels against float64


def _pool(gen, slots, hk, hv, dk, dv, ring_len):
    def randn(*size):
        return torch.randn(*size, generator=gen).to(DEVICE)

    return [randn(slots, hv, dk, dv) * 0.5, randn(slots, hk, ring_len, dk), randn(slots, hv, ring_len, dv),
            randn(slots, hv, ring_len)]


def _drive(shape, window, t, steps, l2norm, seed=0, block_v=None, split_decode=True):
    hk, hv, dk, dv = shape
    gen = torch.Generator().manual_seed(seed)
    live, free, ring_len = 3, 2, window + t
    pool = _pool(gen, live + free, hk, hv, dk, dv, ring_len)
    pool64 = [x.double() for x in pool]
    cursors = [torch.zeros(live + free, dtype=torch.int32, device=DEVICE) for _ in range(2)]
    cursors.append(torch.zeros(live + free, dtype=torch.bool, device=DEVICE))
    flushes = 0
    for step in range(steps):
        slots = torch.randperm(live, generator=gen)
        if step % 3 == 2:
            slots[1] = -1
        n = torch.randint(1, t + 1, (live,), generator=gen)
        q, k = (torch.randn(live, t, hk, dk, generator=gen) for _ in range(2))
        if not l2norm:  # keys of norm about 1, as the models' normalized keys: |k|^2 = K makes I - beta k k^T expand
            k = k * dk**-0.5
        v = torch.randn(live, t, hv, dv, generator=gen)
        g, beta = -torch.rand(live, t, hv, generator=gen), torch.rand(live, t, hv, generator=gen)
        inputs = [x.to(DEVICE) for x in (q, k, v, g, beta)]
        slots, n = slots.to(DEVICE), n.to(DEVICE)
        replay_prepare_ref(*cursors, slots, n, torch.zeros(live, dtype=torch.bool, device=DEVICE), window)
        flushes += int(cursors[2][slots[slots >= 0]].sum())
        o = tk.replay_gdn_step_triton(*pool, *cursors, slots, n, *inputs, use_qk_l2norm=l2norm, block_v=block_v,
                                      split_decode=split_decode)
        o64 = ref.replay_gdn_step_ref(*pool64, *cursors, slots, n, *(x.double() for x in inputs), use_qk_l2norm=l2norm)
        torch.testing.assert_close(o.double(), o64, rtol=TOL[0], atol=TOL[1])
        for x, x64 in zip(pool, pool64, strict=True):
            torch.testing.assert_close(x.double(), x64, rtol=TOL[0], atol=TOL[1])
        accepted = torch.randint(1, t + 1, (live,), generator=gen).to(DEVICE).minimum(n)
        replay_commit_ref(*cursors, slots, accepted, ring_len)
        if step % 2:  # fold a random prefix of a live slot's history into a free slot, and in place
            src = torch.tensor([step % live, (step + 1) % live], device=DEVICE)
            dst = torch.tensor([live + step % free, (step + 1) % live], device=DEVICE)
            count = torch.stack([torch.randint(0, int(cursors[1][src[0]]) + 1, (1,), generator=gen)[0].to(DEVICE),
                                 cursors[1][src[1]].long()]).to(torch.int32)
            start = cursors[0][src].clone()
            tk.replay_gdn_materialize_triton(*pool, src, dst, start, count, use_qk_l2norm=l2norm, block_v=block_v)
            ref.replay_gdn_materialize_ref(*pool64, src, dst, start, count, use_qk_l2norm=l2norm)
            torch.testing.assert_close(pool[0].double(), pool64[0], rtol=TOL[0], atol=TOL[1])
            cursors[1][src[1]] = 0  # the in-place fold consumed that slot's history
    return flushes


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize(("shape", "window", "t", "split_decode"), [  # split_decode: T = 1's two read paths
    pytest.param((1, 2, 16, 16), 4, 3, True, id="hk1-hv2-k16-v16-W4-T3"),
    pytest.param((2, 4, 16, 32), 3, 1, True, id="hk2-hv4-k16-v32-W3-T1-split"),
    pytest.param((2, 4, 16, 32), 3, 1, False, id="hk2-hv4-k16-v32-W3-T1-fused"),
    pytest.param((1, 2, 32, 16), 12, 4, True, id="hk1-hv2-k32-v16-W12-T4"),
])
def test_step_and_materialize_match_the_reference(shape, window, t, l2norm, split_decode):
    assert _drive(shape, window, t, steps=2 * window + 4, l2norm=l2norm, split_decode=split_decode) > 0


@pytest.mark.parametrize("block_v", [128, 64, None])  # None: 4 V tiles of 32, as the Qwen3.5 shape runs
@pytest.mark.parametrize(("t", "split_decode"), [(1, True), (1, False), (2, True)])
def test_head_dim_128(block_v, t, split_decode):
    assert _drive((1, 1, 128, 128), 4, t, steps=8, l2norm=True, seed=1, block_v=block_v,
                  split_decode=split_decode) > 0


def test_entry_points_take_the_kernels_under_force_triton():
    """The entry points check the pool, then run the kernels (force_triton) or the references, which
    skip the pad slot's rows where the kernels run them on the pad slot."""
    from replayserve.ops.dispatch import force_triton

    gen = torch.Generator().manual_seed(4)
    pool = _pool(gen, 3, 1, 2, 16, 16, 5)
    ref_pool = [x.clone() for x in pool]
    cursors = [torch.tensor([0, 2, 0], dtype=torch.int32, device=DEVICE), torch.tensor([2, 1, 0], dtype=torch.int32,
               device=DEVICE), torch.tensor([False, False, False], device=DEVICE)]
    slots, n = torch.tensor([1, 0, 2], device=DEVICE), torch.tensor([1, 1, 1], device=DEVICE)
    q, k = (torch.randn(3, 1, 1, 16, generator=gen).to(DEVICE) for _ in range(2))
    v, g, beta = torch.randn(3, 1, 2, 16, generator=gen), -torch.rand(3, 1, 2, generator=gen), torch.rand(3, 1, 2)
    inputs = [q, k, v.to(DEVICE), g.to(DEVICE), beta.to(DEVICE)]
    with force_triton():
        o = ref.replay_gdn_step(*pool, *cursors, slots, n, *inputs, use_qk_l2norm=True, pad_slot=2)
    # The references by name: on a GPU the entry points take the kernels even without force_triton.
    o_ref = ref.replay_gdn_step_ref(*ref_pool, *cursors, slots.masked_fill(slots == 2, -1), n, *inputs,
                                    use_qk_l2norm=True)
    torch.testing.assert_close(o[:2], o_ref[:2], rtol=1e-5, atol=1e-5)
    assert not o_ref[2].any(), "the reference skips the pad slot's row"
    args = (torch.tensor([0], device=DEVICE), torch.tensor([2], device=DEVICE), cursors[0][:1], cursors[1][:1])
    with force_triton():
        ref.replay_gdn_materialize(*pool, *args, use_qk_l2norm=True)
    ref.replay_gdn_materialize_ref(*ref_pool, *args, use_qk_l2norm=True)
    torch.testing.assert_close(pool[0][2], ref_pool[0][2], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="ring shapes"):
        ref.replay_gdn_step(pool[0], pool[1][:, :, :4], *pool[2:], *cursors, slots, n, *inputs)


@pytest.mark.parametrize(("window", "t"), [(28, 4), (60, 4), (16, 16)])  # E = 32 and 64 entries; T = 16
def test_alike_keys_stay_accurate(window, t):
    """Keys close to one another, beta near 1, little decay: the new tokens' system (I + A) delta = b
    has A_ij near 1 below the diagonal, where an inverse by powers of A would cancel catastrophically
    in fp32; the kernel substitutes row by row. A full history of 28 or 60 entries is replayed."""
    gen = torch.Generator().manual_seed(5)
    hv, dk, dv, ring_len = 2, 64, 32, window + t
    common = torch.randn(dk, generator=gen)

    def alike(*size):
        return (common + 0.3 * torch.randn(*size, dk, generator=gen)).to(DEVICE)

    pool = [torch.randn(2, hv, dk, dv, generator=gen).to(DEVICE) * 0.5, alike(2, 1, ring_len),
            torch.randn(2, hv, ring_len, dv, generator=gen).to(DEVICE),
            (-0.02 * torch.rand(2, hv, ring_len, generator=gen)).to(DEVICE)]
    pool64 = [x.double() for x in pool]
    cursors = [torch.zeros(2, dtype=torch.int32, device=DEVICE), torch.full((2,), window, dtype=torch.int32,
               device=DEVICE), torch.zeros(2, dtype=torch.bool, device=DEVICE)]
    slots, n = torch.arange(2, device=DEVICE), torch.full((2,), t, device=DEVICE)
    inputs = [torch.randn(2, t, 1, dk, generator=gen).to(DEVICE), alike(2, t, 1),
              torch.randn(2, t, hv, dv, generator=gen).to(DEVICE),
              (-0.02 * torch.rand(2, t, hv, generator=gen)).to(DEVICE),
              (0.5 + 0.5 * torch.rand(2, t, hv, generator=gen)).to(DEVICE)]
    o = tk.replay_gdn_step_triton(*pool, *cursors, slots, n, *inputs, use_qk_l2norm=True)
    o64 = ref.replay_gdn_step_ref(*pool64, *cursors, slots, n, *(x.double() for x in inputs), use_qk_l2norm=True)
    torch.testing.assert_close(o.double(), o64, rtol=1e-5, atol=1e-5)
    args = (torch.tensor([0], device=DEVICE), torch.tensor([1], device=DEVICE), cursors[0][:1],
            torch.tensor([ring_len - 1], dtype=torch.int32, device=DEVICE))
    tk.replay_gdn_materialize_triton(*pool, *args, use_qk_l2norm=True)
    ref.replay_gdn_materialize_ref(*pool64, *args, use_qk_l2norm=True)
    torch.testing.assert_close(pool[0][1].double(), pool64[0][1], rtol=1e-5, atol=1e-5)
