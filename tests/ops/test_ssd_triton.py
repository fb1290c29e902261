"""Triton packed varlen SSD scan against the float64 ``ssd_varlen_scan_ref``.

Every case draws fresh inputs: a state pool with random states in every slot (so initial states are
nonzero), sequences in shuffled slot order, x/B/C as strided views of one projection buffer. The
kernel must match the reference's outputs, final states (written to the right slots only) and grid
states. fp32 runs in the Triton interpreter on CPU; bf16 and the Nemotron-H-8B shape need CUDA.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from replayserve.ops.ssd import ssd_varlen_scan_ref
from replayserve.ops.ssd_triton import ssd_varlen_scan_triton, varlen_chunks

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
SMALL, BIG = (4, 8, 8, 2), (128, 64, 128, 8)  # (H, P, N, G)
# (rtol, atol, relative L2 error) against float64, on tensors scaled by the reference's RMS: 16-bit
# kernels round the operands of every tensor-core product (decay-weighted B, scores, carried state).
TOL = {torch.float32: (1e-4, 1e-3, 1e-5), torch.bfloat16: (6e-2, 2e-1, 1e-2), torch.float16: (6e-2, 2e-1, 3e-3)}
POOL = 9


def make(lens: list[int], shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int,
         optional: bool = True) -> dict[str, Tensor | None]:
    """Packed inputs for sequences of `lens` tokens, on DEVICE."""
    nheads, headdim, dstate, ngroups = shape
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)

    def randn(*size: int) -> Tensor:
        return torch.randn(*size, generator=gen).to(DEVICE)

    # x, B and C as the mixer sees them: column slices of one (T, conv_dim) buffer.
    width = nheads * headdim + 2 * ngroups * dstate
    xbc = randn(total, width + 3).to(dtype)[:, 1 : width + 1]
    x, bc = xbc[:, : nheads * headdim], xbc[:, nheads * headdim :]
    return {
        "x": x.unflatten(1, (nheads, headdim)),
        "dt": randn(total, nheads).to(dtype),
        "A": -torch.exp(randn(nheads) * 0.5),
        "B": bc[:, : ngroups * dstate].unflatten(1, (ngroups, dstate)),
        "C": bc[:, ngroups * dstate :].unflatten(1, (ngroups, dstate)),
        "D": randn(nheads) if optional else None,
        "dt_bias": randn(nheads) * 0.5 if optional else None,
        "pool": randn(POOL, nheads, headdim, dstate),
        "slots": torch.randperm(POOL, generator=gen)[: len(lens)].to(DEVICE),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=DEVICE),
    }


def as_ref(t: Tensor | None) -> Tensor | None:
    return None if t is None else t.double()


def check(lens: list[int], phases: list[int], chunk_size: int, shape: tuple[int, int, int, int],
          dtype: torch.dtype, seed: int, optional: bool = True,
          dt_limit: tuple[float, float] = (0.0, math.inf)) -> None:
    inp = make(lens, shape, dtype, seed, optional)
    phase = torch.tensor(phases, device=DEVICE)
    pool, slots = inp["pool"], inp["slots"]
    ref_pool = pool.double()
    unused = [s for s in range(POOL) if s not in slots.tolist()]
    before = pool[unused].clone()
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, inp["cu_seqlens"], phase)
    y, grid = ssd_varlen_scan_triton(*args, pool, slots, inp["D"], inp["dt_bias"], dt_limit=dt_limit,
                                     return_grid_states=True)
    y_ref, grid_ref = ssd_varlen_scan_ref(*(as_ref(t) for t in args[:5]), *args[5:], ref_pool, slots,
                                          as_ref(inp["D"]), as_ref(inp["dt_bias"]), dt_limit=dt_limit,
                                          return_grid_states=True)
    assert y.dtype == dtype and grid.dtype == torch.float32
    num_chunks = sum(-(-(n + p) // chunk_size) for n, p in zip(lens, phases, strict=True))
    assert grid.shape == grid_ref.shape == (num_chunks, *shape[:3])
    close(y, y_ref, dtype)
    close(grid, grid_ref, dtype)
    close(pool, ref_pool, dtype)
    assert torch.equal(pool[unused], before), "slots outside the batch are untouched"


def close(actual: Tensor, expected: Tensor, dtype: torch.dtype) -> None:
    rtol, atol, l2 = TOL[dtype]
    scale = expected.square().mean().sqrt()
    torch.testing.assert_close(actual.double() / scale, expected / scale, rtol=rtol, atol=atol)
    assert ((actual.double() - expected).norm() / expected.norm()).item() < l2


# (lens, phases, chunk_size): each names what it covers.
CPU_CASES = {
    "shorter-than-a-chunk": ([5, 3, 1], [0, 2, 15], 16),
    "mid-grid-starts": ([20, 9, 33], [7, 15, 1], 16),
    "one-long-sequence": ([150], [5], 16),
    "chunk-below-the-tile": ([13, 30], [3, 0], 8),
    "chunk-not-a-power-of-two": ([25, 4], [11, 2], 12),
}


@pytest.mark.parametrize(("lens", "phases", "chunk_size"), list(CPU_CASES.values()), ids=list(CPU_CASES))
def test_scan_matches_reference(lens: list[int], phases: list[int], chunk_size: int) -> None:
    check(lens, phases, chunk_size, SMALL, torch.float32, seed=sum(lens) + chunk_size)


def test_scan_without_skip_or_bias_and_with_a_dt_clamp() -> None:
    check([17, 6], [4, 0], 16, (4, 8, 16, 1), torch.float32, seed=3, optional=False, dt_limit=(0.1, 0.9))


def test_chunk_table_is_shared_and_checked() -> None:
    """One table serves several layers; a table for another chunk size or other tokens is refused."""
    lens, phases, chunk_size = [10, 21], [9, 3], 16
    inp = make(lens, SMALL, torch.float32, seed=11)
    chunks = varlen_chunks(lens, phases, chunk_size, DEVICE)
    assert chunks.num_chunks == 4 and chunks.seq_chunks.tolist() == [0, 2, 4]
    assert chunks.table.tolist() == [[0, 0, 1, 1], [0, 7, 10, 23], [7, 3, 13, 8]]
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, inp["cu_seqlens"],
            torch.tensor(phases, device=DEVICE))
    ref_pool = inp["pool"].double()
    for _ in range(2):  # two layers' scans from one table, the second from the first one's states
        y = ssd_varlen_scan_triton(*args, inp["pool"], inp["slots"], inp["D"], inp["dt_bias"], chunks=chunks)
        y_ref = ssd_varlen_scan_ref(*(as_ref(t) for t in args[:5]), *args[5:], ref_pool, inp["slots"],
                                    as_ref(inp["D"]), as_ref(inp["dt_bias"]))
        close(y, y_ref, torch.float32)
        close(inp["pool"], ref_pool, torch.float32)
    with pytest.raises(ValueError, match="chunk size"):
        ssd_varlen_scan_triton(*args[:5], 8, *args[6:], inp["pool"], inp["slots"], chunks=chunks)
    with pytest.raises(ValueError, match="covers 30 tokens"):
        ssd_varlen_scan_triton(*args, inp["pool"], inp["slots"], chunks=varlen_chunks([10, 20], phases, 16, DEVICE))
    with pytest.raises(ValueError, match="at least one"):
        varlen_chunks([4, 0], [0, 0], 16, DEVICE)
    with pytest.raises(ValueError, match="phase 16"):
        varlen_chunks([4], [16], 16, DEVICE)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scan_matches_reference_at_nemotron_shape(dtype: torch.dtype) -> None:
    lens, phases = [1024, 300, 77, 1, 129], [0, 50, 127, 3, 64]
    check(lens, phases, 128, BIG, dtype, seed=5)


@cuda_only
def test_scan_one_long_prompt_bf16() -> None:
    check([4096], [0], 128, BIG, torch.bfloat16, seed=6)


def test_cuts_return_the_states_off_the_grid() -> None:
    """Extra chunk starts (a prefix-caching boundary off the grid) leave y and the final states as they
    were, and the state entering each chunk is the state after the tokens before it."""
    lens, phases, chunk_size = [30, 9], [3, 0], 16
    cuts = [[7, 13, 20], [4]]  # 13 is on the first sequence's grid (3 + 13 = 16)
    inp = make(lens, SMALL, torch.float32, seed=21)
    chunks = varlen_chunks(lens, phases, chunk_size, DEVICE, cuts=cuts)
    assert chunks.chunk_starts == (0, 7, 13, 20, 29, 30, 34)
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, inp["cu_seqlens"],
            torch.tensor(phases, device=DEVICE))
    start_pool = inp["pool"].clone()
    y, grid = ssd_varlen_scan_triton(*args, inp["pool"], inp["slots"], inp["D"], inp["dt_bias"],
                                     return_grid_states=True, chunks=chunks)
    ref_pool = start_pool.double()
    y_ref = ssd_varlen_scan_ref(*(as_ref(t) for t in args[:5]), *args[5:], ref_pool, inp["slots"],
                                as_ref(inp["D"]), as_ref(inp["dt_bias"]))
    close(y, y_ref, torch.float32)
    close(inp["pool"], ref_pool, torch.float32)
    for k, (seq, offset) in enumerate([(0, 0), (0, 7), (0, 13), (0, 20), (0, 29), (1, 0), (1, 4)]):
        if offset == 0:
            assert torch.equal(grid[k], start_pool[inp["slots"][seq]])
            continue
        lo = lens[0] * seq
        prefix_pool = start_pool.double()
        ssd_varlen_scan_ref(*(as_ref(t)[lo : lo + offset] for t in (args[0], args[1])), as_ref(args[2]),
                            *(as_ref(t)[lo : lo + offset] for t in (args[3], args[4])), chunk_size,
                            torch.tensor([0, offset]), torch.tensor([phases[seq]]), prefix_pool,
                            inp["slots"][seq : seq + 1], None, as_ref(inp["dt_bias"]))
        close(grid[k], prefix_pool[inp["slots"][seq]], torch.float32)
    with pytest.raises(ValueError, match="cuts"):
        varlen_chunks(lens, phases, chunk_size, DEVICE, cuts=[[30], []])


@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if CUDA else []))
def test_captured_states_land_in_their_slots(dtype: torch.dtype) -> None:
    """capture_slots / end_slots store the state entering chunks and a sequence's final state into
    other slots: exactly the grid and final states the scan computes, in the pool's dtype, with
    every other slot and the outputs unchanged."""
    lens, phases, chunk_size = [30, 9, 5], [3, 0, 2], 16
    inp = make(lens, SMALL, dtype, seed=31)
    chunks = varlen_chunks(lens, phases, chunk_size, DEVICE, cuts=[[7, 20], [4], []])
    slots = inp["slots"].tolist()
    free = [s for s in range(POOL) if s not in slots]  # 6 slots for captures
    # chunk starts (0, 7, 13, 20, 29 | 30, 34 | 39): capture chunks 2, 3 and 6; sequences 0 and 2 end in a slot
    capture = [-1, -1, free[0], free[1], -1, -1, free[2], -1]
    ends = [free[3], -1, free[4]]
    args = (inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], chunk_size, inp["cu_seqlens"],
            torch.tensor(phases, device=DEVICE))
    plain_pool = inp["pool"].clone()
    y0, grid = ssd_varlen_scan_triton(*args, plain_pool, inp["slots"], inp["D"], inp["dt_bias"],
                                      return_grid_states=True, chunks=chunks)
    pool = inp["pool"].clone()
    y = ssd_varlen_scan_triton(*args, pool, inp["slots"], inp["D"], inp["dt_bias"], chunks=chunks,
                               capture_slots=torch.tensor(capture, device=DEVICE),
                               end_slots=torch.tensor(ends, device=DEVICE))
    assert torch.equal(y, y0)
    expected = plain_pool.clone()
    for k, dst in enumerate(capture):
        if dst >= 0:
            expected[dst] = grid[k].to(pool.dtype)
    for s, dst in enumerate(ends):
        if dst >= 0:
            expected[dst] = plain_pool[slots[s]]
    assert torch.equal(pool, expected)
    assert not torch.equal(expected[free[0]], inp["pool"][free[0]]), "the capture changed its slot"
    with pytest.raises(ValueError, match="go together"):
        ssd_varlen_scan_triton(*args, pool, inp["slots"], chunks=chunks, capture_slots=torch.tensor(capture))
    with pytest.raises(ValueError, match="capture_slots"):
        ssd_varlen_scan_triton(*args, pool, inp["slots"], chunks=chunks, capture_slots=torch.tensor(capture[:3]),
                               end_slots=torch.tensor(ends))
