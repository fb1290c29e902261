from __future__ import annotations

import math

import pytest
import torch

from replayserve.ops.ssd import ssd_chunk_scan_ref, ssd_varlen_scan_ref
from replayserve.ops.ssu import selective_state_update_ref

F64 = torch.float64
TOL = 1e-10
SHAPES = [(8, 16, 16, 2), (4, 8, 8, 1)]  # (H, P, N, G)
Inputs = dict[str, torch.Tensor]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def make_inputs(seqlen: int, shape: tuple[int, int, int, int], seed: int) -> Inputs:
    nheads, headdim, dstate, ngroups = shape
    gen = torch.Generator().manual_seed(seed)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=F64)

    return {
        "x": randn(seqlen, nheads, headdim),
        "dt": randn(seqlen, nheads),
        "A": -torch.exp(randn(nheads)),
        "B": randn(seqlen, ngroups, dstate),
        "C": randn(seqlen, ngroups, dstate),
        "D": randn(nheads),
        "dt_bias": randn(nheads) * 0.5,
        "initial_state": randn(nheads, headdim, dstate),
    }


def recurrence(
    inp: Inputs,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    softplus: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSM written out token by token, straight from the formula."""
    x, A, B, C = inp["x"], inp["A"], inp["B"], inp["C"]
    seqlen, nheads, _ = x.shape
    group_of_head = torch.arange(nheads) // (nheads // B.shape[1])
    state = inp["initial_state"].clone()
    ys = []
    for t in range(seqlen):
        delta = inp["dt"][t] + inp["dt_bias"]
        if softplus:
            delta = torch.log1p(torch.exp(delta))
        delta = delta.clamp(min=dt_limit[0], max=dt_limit[1])
        b_t, c_t = B[t, group_of_head], C[t, group_of_head]  # (H, N)
        for h in range(nheads):
            state[h] = math.exp(delta[h] * A[h]) * state[h] + delta[h] * torch.outer(x[t, h], b_t[h])
        y_t = torch.stack([state[h] @ c_t[h] for h in range(nheads)]) + inp["D"][:, None] * x[t]
        ys.append(y_t)
    return torch.stack(ys), state


def scan(inp: Inputs, chunk_size: int, **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
    return ssd_chunk_scan_ref(
        inp["x"],
        inp["dt"],
        inp["A"],
        inp["B"],
        inp["C"],
        chunk_size,
        D=inp["D"],
        dt_bias=inp["dt_bias"],
        initial_state=inp["initial_state"],
        **kwargs,
    )


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("seqlen", "chunk_size"), [(64, 16), (50, 16), (10, 16), (1, 16), (23, 4), (7, 1)])
def test_chunk_scan_matches_recurrence(shape: tuple[int, ...], seqlen: int, chunk_size: int) -> None:
    inp = make_inputs(seqlen, shape, seed=seqlen * 31 + chunk_size)
    y, final = scan(inp, chunk_size)
    y_exp, final_exp = recurrence(inp)
    assert y.shape == inp["x"].shape and y.dtype == F64
    assert final.shape == inp["initial_state"].shape and final.dtype == F64
    assert rel_err(y, y_exp) < TOL
    assert rel_err(final, final_exp) < TOL


@pytest.mark.parametrize(("seqlen", "phase"), [(40, 5), (11, 15), (16, 1), (3, 9)])
def test_chunk_phase_keeps_the_grid_of_the_whole_sequence(seqlen: int, phase: int) -> None:
    """A chunk starting `phase` tokens past a grid point: outputs and final state unchanged, and
    grid entry c is the state after the first c * chunk_size - phase tokens."""
    chunk = 16
    inp = make_inputs(seqlen, SHAPES[0], seed=seqlen + 7 * phase)
    y, final, grid = scan(inp, chunk, return_chunk_states=True, chunk_phase=phase)
    y_exp, final_exp = recurrence(inp)
    assert rel_err(y, y_exp) < TOL and rel_err(final, final_exp) < TOL
    assert grid.shape[0] == -(-(seqlen + phase) // chunk)
    assert rel_err(grid[0], inp["initial_state"]) == 0
    for c in range(1, grid.shape[0]):
        head = {k: v[: c * chunk - phase] if v.dim() > 1 and k != "initial_state" else v for k, v in inp.items()}
        assert rel_err(grid[c], recurrence(head)[1]) < TOL
    with pytest.raises(ValueError, match="chunk_phase"):
        scan(inp, chunk, chunk_phase=chunk)


def test_chunk_scan_defaults_zero_state_no_skip() -> None:
    inp = make_inputs(19, SHAPES[0], seed=5)
    inp["dt"] = inp["dt"].abs()
    y, final = ssd_chunk_scan_ref(inp["x"], inp["dt"], inp["A"], inp["B"], inp["C"], 8, dt_softplus=False)
    ref_inp = dict(inp, D=torch.zeros_like(inp["D"]), dt_bias=torch.zeros_like(inp["dt_bias"]))
    ref_inp["initial_state"] = torch.zeros_like(inp["initial_state"])
    y_exp, final_exp = recurrence(ref_inp, softplus=False)
    assert rel_err(y, y_exp) < TOL
    assert rel_err(final, final_exp) < TOL


def test_dt_limit_clamp_changes_result_and_matches_recurrence() -> None:
    inp = make_inputs(37, SHAPES[0], seed=11)
    limit = (0.2, 0.8)
    processed = torch.nn.functional.softplus(inp["dt"] + inp["dt_bias"])
    assert (processed < limit[0]).any() and (processed > limit[1]).any()
    y, final = scan(inp, 16, dt_limit=limit)
    y_free, _ = scan(inp, 16)
    assert rel_err(y, y_free) > 1e-2
    y_exp, final_exp = recurrence(inp, dt_limit=limit)
    assert rel_err(y, y_exp) < TOL
    assert rel_err(final, final_exp) < TOL


def step_inputs(inp: Inputs, t: int) -> Inputs:
    return {k: inp[k][t : t + 1] for k in ("x", "dt", "B", "C")}


def decode(pool: torch.Tensor, step: Inputs, params: Inputs, idx: torch.Tensor | None) -> torch.Tensor:
    """One selective_state_update_ref call; ``params`` supplies A, D and dt_bias."""
    return selective_state_update_ref(
        pool,
        step["x"],
        step["dt"],
        params["A"],
        step["B"],
        step["C"],
        D=params["D"],
        dt_bias=params["dt_bias"],
        state_indices=idx,
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_state_update_matches_recurrence_and_leaves_other_slots(shape: tuple[int, int, int, int]) -> None:
    seqlen, slots, idx = 12, 6, torch.tensor([4, 1, 2])
    seqs = [make_inputs(seqlen, shape, seed=40 + b) for b in range(3)]
    # The update takes one A/D/dt_bias for the whole batch.
    for inp in seqs[1:]:
        for key in ("A", "D", "dt_bias"):
            inp[key] = seqs[0][key]
    gen = torch.Generator().manual_seed(99)
    pool = torch.randn(slots, *seqs[0]["initial_state"].shape, generator=gen, dtype=F64)
    for b, inp in enumerate(seqs):
        pool[idx[b]] = inp["initial_state"]
    original = pool.clone()
    ys = []
    for t in range(seqlen):
        steps = [step_inputs(inp, t) for inp in seqs]
        batch = {k: torch.cat([s[k] for s in steps]) for k in steps[0]}
        ys.append(decode(pool, batch, seqs[0], idx))
    y = torch.stack(ys, dim=1)  # (B, L, H, P)
    for b, inp in enumerate(seqs):
        y_exp, final_exp = recurrence(inp)
        assert rel_err(y[b], y_exp) < TOL
        assert rel_err(pool[idx[b]], final_exp) < TOL
    untouched = [0, 3, 5]
    assert torch.equal(pool[untouched], original[untouched])


def test_state_update_default_indices() -> None:
    inp = make_inputs(3, SHAPES[1], seed=3)
    state = inp["initial_state"][None].clone()
    ys = [decode(state, step_inputs(inp, t), inp, None) for t in range(3)]
    y_exp, final_exp = recurrence(inp)
    assert rel_err(torch.cat(ys), y_exp) < TOL
    assert rel_err(state[0], final_exp) < TOL


@pytest.mark.parametrize("prefix", [1, 13, 32])
def test_prefill_then_decode_equals_full_forward(prefix: int) -> None:
    seqlen, chunk_size = 40, 16
    inp = make_inputs(seqlen, SHAPES[0], seed=prefix)
    y_full, final_full = scan(inp, chunk_size)
    pre = {k: (v[:prefix] if k in ("x", "dt", "B", "C") else v) for k, v in inp.items()}
    y_pre, state = scan(pre, chunk_size)
    pool = state[None].clone()
    ys = [y_pre]
    for t in range(prefix, seqlen):
        ys.append(decode(pool, step_inputs(inp, t), inp, torch.tensor([0])))
    assert rel_err(torch.cat(ys), y_full) < TOL
    assert rel_err(pool[0], final_full) < TOL


def test_low_precision_dtypes_and_strong_decay_stay_finite() -> None:
    inp = make_inputs(256, SHAPES[0], seed=77)
    inp["A"] = inp["A"] * 50.0
    y_exp, final_exp = recurrence(inp)
    lo = {k: v.bfloat16() for k, v in inp.items()}
    y, final = scan(lo, 64)
    assert y.dtype == torch.bfloat16 and final.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(final).all()
    assert rel_err(final.double(), final_exp) < 5e-2
    state = lo["initial_state"][None].float()
    y_step = decode(state, step_inputs(lo, 255), lo, None)
    assert y_step.dtype == torch.bfloat16 and state.dtype == torch.float32


def test_varlen_scan_is_each_sequence_from_its_slot() -> None:
    """Packed sequences (mid-grid starts, one shorter than a chunk) against the recurrence of each from
    its slot's state; the final states land in their slots, other slots untouched."""
    lens, phases, slots, chunk = [21, 5, 34], [3, 15, 0], [4, 0, 2], 16
    seqs = [make_inputs(n, SHAPES[0], seed=60 + n) for n in lens]
    for inp in seqs[1:]:
        for key in ("A", "D", "dt_bias"):
            inp[key] = seqs[0][key]
    pool = torch.randn(5, *seqs[0]["initial_state"].shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    for s, inp in zip(slots, seqs, strict=True):
        pool[s] = inp["initial_state"]
    before = pool.clone()
    packed = {k: torch.cat([inp[k] for inp in seqs]) for k in ("x", "dt", "B", "C")}
    y, grid = ssd_varlen_scan_ref(
        packed["x"], packed["dt"], seqs[0]["A"], packed["B"], packed["C"], chunk, torch.tensor([0, 21, 26, 60]),
        torch.tensor(phases), pool, torch.tensor(slots), D=seqs[0]["D"], dt_bias=seqs[0]["dt_bias"],
        return_grid_states=True)
    first_chunk = 0
    for s, inp, n, phase in zip(slots, seqs, [0, 21, 26], phases, strict=True):
        y_exp, final_exp = recurrence(inp)
        assert rel_err(y[n : n + inp["x"].shape[0]], y_exp) < TOL
        assert rel_err(pool[s], final_exp) < TOL
        assert rel_err(grid[first_chunk], inp["initial_state"]) == 0
        first_chunk += -(-(inp["x"].shape[0] + phase) // chunk)
    assert grid.shape[0] == first_chunk == 2 + 2 + 3
    assert torch.equal(pool[[1, 3]], before[[1, 3]])
