"""``replay_flush_triton`` alone against ``replay_materialize_ref`` (src = dst = slot, n = history).

The drives in ``test_replay_ssm_triton`` check the flush inside whole steps; here one call sees
every case at once: flushing rows with full, partial and empty histories, rows that do not flush,
a flushing slot that is not in the step, a padded row, wrapped rings and more flushing rows than
programs, so each program takes several items.
"""

from __future__ import annotations

import pytest
import torch

from replayserve.ops import replay_ssm as ref
from replayserve.ops.replay_flush_triton import replay_flush_triton

CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
SHAPES = [pytest.param((4, 16, 16, 2), id="small"), pytest.param((8, 16, 24, 1), id="n24")]
if CUDA:
    SHAPES.append(pytest.param((128, 64, 128, 8), id="big"))
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (1e-4, 1e-4)}  # the state stays fp32 either way


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("act", [torch.float32] + ([torch.bfloat16] if CUDA else []), ids=str)
def test_flush_folds_exactly_the_flushing_rows_of_the_step(device: str, shape: tuple[int, int, int, int],
                                                           act: torch.dtype) -> None:
    H, P, N, G = shape
    W, slots_n = 7, 12
    R = W + 1
    gen = torch.Generator().manual_seed(H * 100 + N)
    state = torch.randn(slots_n, H, P, N, generator=gen)
    x_ring = torch.randn(slots_n, H, R, P, generator=gen).to(act)
    dt_ring = torch.rand(slots_n, H, R, generator=gen) * 0.5
    B_ring = torch.randn(slots_n, G, R, N, generator=gen).to(act)
    A = -torch.rand(H, generator=gen) - 0.1
    ring_start = torch.randint(0, R, (slots_n,), generator=gen, dtype=torch.int32)
    history = torch.tensor([W, 3, 0, W, 5, 1, W, 2, 6, 4, W, 0], dtype=torch.int32)
    is_flush = torch.tensor([1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1, 0], dtype=torch.bool)
    # Slot 10 flushes but is not in the step; slot 11 is free.
    slots = torch.tensor([4, 0, -1, 7, 2, 3, 9, 1, 6, 8, 5])
    expected = state.double().clone()
    flushing = [s for s in slots.tolist() if s >= 0 and is_flush[s] and history[s] > 0]
    assert len(flushing) > 4  # more items than the 4 programs the interpreter runs
    idx = torch.tensor(flushing)
    ref.replay_materialize_ref(expected, x_ring.double(), dt_ring.double(), B_ring.double(), A.double(),
                               idx, idx, ring_start[idx], history[idx])

    dev = [t.to(device, copy=True) for t in (state, x_ring, dt_ring, B_ring, ring_start, history, is_flush, slots, A)]
    cursors = [t.clone() for t in dev[1:7]]
    replay_flush_triton(*dev)
    got = dev[0].cpu().double()
    rtol, atol = TOL[act]
    for s in range(slots_n):
        if s in flushing:
            torch.testing.assert_close(got[s], expected[s], rtol=rtol, atol=atol)
            assert not torch.equal(got[s], state[s].double())
        else:
            assert torch.equal(got[s], state[s].double()), f"slot {s} must be untouched"
    for before, after in zip(cursors, dev[1:7], strict=True):
        assert torch.equal(before, after)  # rings and cursors are read only
