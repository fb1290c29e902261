"""ReplaySSM Mode B references against the plain step-by-step recurrence (float64 oracle)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from replayserve.ops.replay_ssm import (
    replay_commit_ref,
    replay_copy_slot_ref,
    replay_materialize_ref,
    replay_prepare_ref,
    replay_reset_slot_ref,
    replay_step_ref,
    ring_index,
)
from replayserve.ops.ssu import selective_state_update_ref

F64 = torch.float64
TOL = 1e-10
SHAPES = [(8, 16, 16, 2), (4, 8, 8, 1)]  # (H, P, N, G)
I32 = torch.int32


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, rtol=TOL, atol=TOL)


@dataclass
class Params:
    A: torch.Tensor
    D: torch.Tensor
    dt_bias: torch.Tensor
    dt_limit: tuple[float, float]


@dataclass
class Pool:
    state: torch.Tensor
    x_ring: torch.Tensor
    dt_ring: torch.Tensor
    B_ring: torch.Tensor
    ring_start: torch.Tensor
    history: torch.Tensor
    is_flush: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.state, self.x_ring, self.dt_ring, self.B_ring, self.ring_start, self.history, self.is_flush]

    def cursors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ring_start, self.history, self.is_flush

    def clone(self) -> Pool:
        return Pool(*(t.clone() for t in self.tensors()))


def oracle_delta(dt: torch.Tensor, p: Params) -> torch.Tensor:
    return torch.log1p(torch.exp(dt + p.dt_bias)).clamp(min=p.dt_limit[0], max=p.dt_limit[1])


def oracle_token(
    S: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, b: torch.Tensor, c: torch.Tensor | None, p: Params
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """S_t = e^{Δ_t A} S_{t−1} + Δ_t x_t B_tᵀ, y_t = S_t C_t + D x_t; S (H,P,N), x (H,P), Δ (H,), b/c (G,N)."""
    nheads = S.shape[0]
    g = torch.arange(nheads) // (nheads // b.shape[0])
    S = torch.exp(delta * p.A)[:, None, None] * S + (delta[:, None] * x)[:, :, None] * b[g][:, None, :]
    y = None if c is None else torch.einsum("hpn,hn->hp", S, c[g]) + p.D[:, None] * x
    return S, y


@dataclass
class Track:
    """Host mirror of one slot: cursors and canon[c] = oracle state after c committed tokens."""

    start: int
    m: int
    canon: list[torch.Tensor]

    @property
    def committed(self) -> int:
        return len(self.canon) - 1


class Harness:
    """A pool of `num_slots` slots of which `real` are driven; every other slot must stay bitwise untouched."""

    def __init__(self, shape: tuple[int, int, int, int], W: int, T: int, real: list[int], num_slots: int,
                 seed: int, dt_limit: tuple[float, float] = (0.0, math.inf)) -> None:
        self.shape, self.W, self.T, self.R = shape, W, T, W + T
        H, P, N, G = shape
        self.gen = torch.Generator().manual_seed(seed)
        S, R = num_slots, self.R
        self.p = Params(-torch.exp(self.randn(H)), self.randn(H), 0.5 * self.randn(H), dt_limit)
        self.pool = Pool(self.randn(S, H, P, N), self.randn(S, H, R, P),
                         torch.nn.functional.softplus(self.randn(S, H, R)), self.randn(S, G, R, N),
                         self.randint(0, R, S), self.randint(0, W + 1, S), torch.rand(S, generator=self.gen) < 0.5)
        self.real = real
        # Staggered history: distinct starting m per row (cyclic over a permutation), so rows flush apart.
        perm = torch.randperm(W + 1, generator=self.gen).tolist()
        self.tracks = {s: self.init_track(s, perm[k % (W + 1)]) for k, s in enumerate(real)}
        self.untouched = {s: [t[s].clone() for t in self.pool.tensors()] for s in range(S) if s not in real}

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.gen, dtype=F64)

    def randint(self, lo: int, hi: int, *size: int) -> torch.Tensor:
        return torch.randint(lo, hi, size, generator=self.gen, dtype=I32)

    def init_track(self, s: int, m0: int) -> Track:
        """The ring's logical entries 0..m0-1 become committed history after the checkpoint."""
        pool, start = self.pool, int(self.pool.ring_start[s])
        pool.history[s] = m0
        canon = [pool.state[s].clone()]
        for j in range(m0):
            q = (start + j) % self.R
            canon.append(oracle_token(canon[-1], pool.x_ring[s, :, q], pool.dt_ring[s, :, q], pool.B_ring[s, :, q],
                                      None, self.p)[0])
        return Track(start, m0, canon)

    def check_track(self, s: int) -> None:
        t, pool = self.tracks[s], self.pool
        assert (int(pool.ring_start[s]), int(pool.history[s])) == (t.start, t.m)
        assert 0 <= t.m <= self.W and 0 <= t.start < self.R
        close(pool.state[s], t.canon[t.committed - t.m])

    def check_untouched(self) -> None:
        for s, saved in self.untouched.items():
            assert all(torch.equal(t[s], v) for t, v in zip(self.pool.tensors(), saved, strict=True)), s

    def step(self, pad_rows: int = 0, twin: Pool | None = None) -> dict[int, bool]:
        """One prepare/step/commit over all real slots (random order, padded rows mixed in); returns flushes."""
        H, P, N, G = self.shape
        T, W, p, pool = self.T, self.W, self.p, self.pool
        order = [self.real[i] for i in torch.randperm(len(self.real), generator=self.gen).tolist()]
        for _ in range(pad_rows):
            order.insert(int(torch.randint(0, len(order) + 1, (1,), generator=self.gen)), -1)
        rows = len(order)
        n = [int(torch.randint(1, T + 1, (1,), generator=self.gen)) for _ in order]
        a = [int(torch.randint(1, k + 1, (1,), generator=self.gen)) for k in n]
        x, dt = self.randn(rows, T, H, P), self.randn(rows, T, H)
        B, C = self.randn(rows, T, G, N), self.randn(rows, T, G, N)
        for row, s in enumerate(order):
            # Rejected drafts [a, n) get garbage; positions past n and padded rows get NaN (never read).
            x[row, a[row]:n[row]] *= 10
            dt[row, a[row]:n[row]] += 3
            B[row, a[row]:n[row]] *= 10
            for t in (x, dt, B, C):
                t[row, 0 if s == -1 else n[row]:] = math.nan
        slots, ntok, nacc = torch.tensor(order), torch.tensor(n, dtype=I32), torch.tensor(a, dtype=I32)
        args = (x, dt, p.A, B, C, p.D, p.dt_bias, p.dt_limit)

        before = pool.state.clone()
        replay_prepare_ref(*pool.cursors(), slots, ntok, torch.zeros(rows, dtype=torch.bool), W)
        y = replay_step_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, *pool.cursors(), slots, ntok, *args)
        flushes: dict[int, bool] = {}
        for row, s in enumerate(order):
            if s == -1:
                assert torch.equal(y[row], torch.zeros_like(y[row]))
                continue
            tr = self.tracks[s]
            flush = tr.m + n[row] > W
            assert bool(pool.is_flush[s]) == flush
            flushes[s] = flush
            if not (flush and tr.m > 0):
                assert torch.equal(pool.state[s], before[s])
            S = tr.canon[-1]
            for i in range(n[row]):  # every processed position, drafts included, continues the recurrence
                delta = oracle_delta(dt[row, i], p)
                S, yi = oracle_token(S, x[row, i], delta, B[row, i], C[row, i], p)
                close(y[row, i], yi)
                q = (tr.start + tr.m + i) % self.R
                assert torch.equal(pool.x_ring[s, :, q], x[row, i]) and torch.equal(pool.B_ring[s, :, q], B[row, i])
                close(pool.dt_ring[s, :, q], delta)
                if i < a[row]:
                    tr.canon.append(S)
            assert torch.equal(y[row, n[row]:], torch.zeros_like(y[row, n[row]:]))
        replay_commit_ref(*pool.cursors(), slots, nacc, self.R)
        for s in flushes:
            tr, k = self.tracks[s], order.index(s)
            if flushes[s]:
                tr.start, tr.m = (tr.start + tr.m) % self.R, a[k]
            else:
                tr.m += a[k]
            self.check_track(s)

        if twin is not None:  # the same step without the padded rows must be bitwise identical
            keep = torch.tensor([row for row, s in enumerate(order) if s != -1])
            sub = [t[keep] for t in args[:2]] + [args[2]] + [t[keep] for t in args[3:5]] + list(args[5:])
            replay_prepare_ref(*twin.cursors(), slots[keep], ntok[keep], torch.zeros(len(keep), dtype=torch.bool), W)
            y2 = replay_step_ref(twin.state, twin.x_ring, twin.dt_ring, twin.B_ring, *twin.cursors(), slots[keep],
                                 ntok[keep], *sub)
            replay_commit_ref(*twin.cursors(), slots[keep], nacc[keep], self.R)
            assert torch.equal(y[keep], y2)
            assert all(torch.equal(u, v) for u, v in zip(pool.tensors(), twin.tensors(), strict=True))
        return flushes


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("W", [1, 2, 5, 16])
def test_decode_drive_matches_recurrence_across_flushes(shape: tuple[int, int, int, int], W: int) -> None:
    h = Harness(shape, W, 1, real=[3, 0, 4], num_slots=6, seed=W)
    for s in h.real:
        h.check_track(s)
    pattern = {s: [] for s in h.real}
    for _ in range(200):
        for s, f in h.step().items():
            pattern[s].append(f)
    assert all(sum(f) >= 200 // (W + 1) for f in pattern.values())  # a flush every W + 1 steps at T = 1
    assert len({tuple(f) for f in pattern.values()}) > 1  # staggered: rows flush on different steps
    h.check_untouched()


@pytest.mark.parametrize("shape", SHAPES)
def test_window_one_equals_baseline_update(shape: tuple[int, int, int, int]) -> None:
    h = Harness(shape, 1, 1, real=[2, 0, 3], num_slots=4, seed=7)
    pool, p = h.pool, h.p
    pool.history.zero_()
    base = pool.state.clone()
    slots, ones = torch.tensor(h.real), torch.ones(3, dtype=I32)
    H, P, N, G = shape
    for _ in range(60):
        x, dt, B, C = h.randn(3, 1, H, P), h.randn(3, 1, H), h.randn(3, 1, G, N), h.randn(3, 1, G, N)
        y_base = selective_state_update_ref(base, x[:, 0], dt[:, 0], p.A, B[:, 0], C[:, 0], p.D, p.dt_bias,
                                            state_indices=slots)
        replay_prepare_ref(*pool.cursors(), slots, ones, torch.zeros(3, dtype=torch.bool), 1)
        y = replay_step_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, *pool.cursors(), slots, ones,
                            x, dt, p.A, B, C, p.D, p.dt_bias, p.dt_limit)
        replay_commit_ref(*pool.cursors(), slots, ones, 2)
        close(y[:, 0], y_base)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("W", [16, 5])
def test_random_rollback_with_padded_rows(shape: tuple[int, int, int, int], W: int) -> None:
    h = Harness(shape, W, 4, real=[5, 1, 2], num_slots=7, seed=100 + W, dt_limit=(0.05, 2.5))
    twin = h.pool.clone()
    num_flush = 0
    for _ in range(40):
        num_flush += sum(h.step(pad_rows=2, twin=twin).values())
    assert 0 < num_flush < 40 * 3
    h.check_untouched()


def test_cursor_trace_of_design_doc() -> None:
    """The trace in docs/replayssm.md (Cursors): W = 4, T = 2, R = 6, n = 2 every step; the pool is
    tiny so appends are visible."""
    h = Harness((1, 1, 1, 1), 4, 2, real=[0], num_slots=1, seed=3)
    pool, p = h.pool, h.p
    replay_reset_slot_ref(*pool.cursors(), torch.tensor([0]))
    h.tracks[0] = Track(0, 0, [pool.state[0].clone()])
    table = [  # start, m before | flush | appends | a | start, m after | checkpoint covers
        (0, 0, False, [0, 1], 1, 0, 1, 0),
        (0, 1, False, [1, 2], 2, 0, 3, 0),
        (0, 3, True, [3, 4], 2, 3, 2, 3),
        (3, 2, False, [5, 0], 1, 3, 3, 3),
        (3, 3, True, [0, 1], 2, 0, 2, 6),
    ]
    slots, two = torch.tensor([0]), torch.tensor([2], dtype=I32)
    for step, (s0, m0, flush, appends, a, s1, m1, covers) in enumerate(table, 1):
        assert (int(pool.ring_start[0]), int(pool.history[0])) == (s0, m0)
        replay_prepare_ref(*pool.cursors(), slots, two, torch.tensor([False]), 4)
        assert bool(pool.is_flush[0]) == flush
        x = torch.tensor([10.0 * step, 10.0 * step + 1], dtype=F64).reshape(1, 2, 1, 1)
        bc = h.randn(1, 2, 1, 1)
        replay_step_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, *pool.cursors(), slots, two,
                        x, h.randn(1, 2, 1), p.A, bc, bc, p.D, p.dt_bias)
        assert [ring_index(s0, m0 + i, 6) for i in range(2)] == appends
        assert pool.x_ring[0, 0, appends, 0].tolist() == x.flatten().tolist()
        replay_commit_ref(*pool.cursors(), slots, torch.tensor([a], dtype=I32), 6)
        assert (int(pool.ring_start[0]), int(pool.history[0])) == (s1, m1)
        assert [1, 3, 5, 6, 8][step - 1] - m1 == covers


def test_wrap_is_conditional_subtraction_not_bitmask() -> None:
    assert ring_index(18, 5, 20) == 3 and (18 + 5) & 19 == 19
    assert [ring_index(s, j, 6) for s, j in [(0, 5), (5, 0), (5, 1), (3, 5)]] == [5, 5, 0, 2]
    with pytest.raises(ValueError):
        ring_index(20, 0, 20)
    # W = 16, T = 4, R = 20: a flush commit from start 18 past m = 15 lands at 13 (a mask gives 1).
    cur = (torch.tensor([18], dtype=I32), torch.tensor([15], dtype=I32), torch.tensor([True]))
    replay_commit_ref(*cur, torch.tensor([0]), torch.tensor([3], dtype=I32), 20)
    assert (int(cur[0][0]), int(cur[1][0])) == (13, 3) and (18 + 15) & 19 == 1


def test_zero_accept_rows_and_fresh_reset() -> None:
    W = 4
    start, hist, flush = torch.tensor([2, 5, 5], dtype=I32), torch.tensor([3, 4, 3], dtype=I32), torch.tensor(
        [True, False, True])
    slots = torch.tensor([0, 1, 2])
    # Slots 0/1 hold stale flags; slot 2 is recycled with a leftover history (3 + 2 > 4 would flush).
    replay_prepare_ref(start, hist, flush, slots, torch.tensor([1, 1, 2], dtype=I32),
                       torch.tensor([False, False, True]), W)
    assert flush.tolist() == [False, True, False]
    assert start.tolist() == [2, 5, 0] and hist.tolist() == [3, 4, 0]
    replay_commit_ref(start, hist, flush, slots, torch.tensor([0, 0, 2], dtype=I32), 6)
    assert start.tolist() == [2, 5, 0] and hist.tolist() == [3, 4, 2]  # zero-accept rows: no commit


def test_random_cursor_state_machine_matches_mirror() -> None:
    gen = torch.Generator().manual_seed(11)
    W, T, S = 5, 3, 4
    R = W + T
    cur = (torch.zeros(S, dtype=I32), torch.zeros(S, dtype=I32), torch.zeros(S, dtype=torch.bool))
    mirror = [[0, 0] for _ in range(S)]
    flushes = 0
    for _ in range(400):
        slots = [s for s in range(S) if torch.rand(1, generator=gen) < 0.8] + [-1]
        n = [int(torch.randint(1, T + 1, (1,), generator=gen)) for _ in slots]
        a = [0 if torch.rand(1, generator=gen) < 0.15 else int(torch.randint(1, k + 1, (1,), generator=gen)) for k in n]
        fresh = [bool(torch.rand(1, generator=gen) < 0.05) for _ in slots]
        st = torch.tensor(slots)
        replay_prepare_ref(*cur, st, torch.tensor(n, dtype=I32), torch.tensor(fresh), W)
        replay_commit_ref(*cur, st, torch.tensor(a, dtype=I32), R)
        for s, k, acc, f in zip(slots, n, a, fresh, strict=True):
            if s == -1:
                continue
            if f:
                mirror[s] = [0, 0]
            is_flush = mirror[s][1] + k > W
            assert bool(cur[2][s]) == is_flush
            if acc and is_flush:
                mirror[s] = [(mirror[s][0] + mirror[s][1]) % R, acc]
                flushes += 1
            elif acc:
                mirror[s][1] += acc
        assert [[int(cur[0][s]), int(cur[1][s])] for s in range(S)] == mirror
        assert all(0 <= m <= W and 0 <= b < R for b, m in mirror)
    assert flushes > 50


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("W", [16, 5])
def test_materialize_folds_prefix_of_history(shape: tuple[int, int, int, int], W: int) -> None:
    h = Harness(shape, W, 4, real=[0, 2, 4], num_slots=8, seed=200 + W)
    spare = [5, 6, 7]
    for s in spare:
        del h.untouched[s]
    pool = h.pool
    for it in range(30):
        h.step(pad_rows=1)
        if it % 3:
            continue
        ns = [int(torch.randint(0, h.tracks[s].m + 1, (1,), generator=h.gen)) for s in h.real]
        ns[it % 3] = 0 if it % 2 else ns[it % 3]  # n = 0 rows too
        src = torch.tensor(h.real + [-1, 1])
        dst = torch.tensor(spare + [3, -1])  # padded rows either way
        rs = torch.tensor([h.tracks[s].start for s in h.real] + [0, 0], dtype=I32)
        saved = pool.clone()
        replay_materialize_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, h.p.A, src, dst, rs,
                               torch.tensor(ns + [0, 0], dtype=I32))
        for s, d, k in zip(h.real, spare, ns, strict=True):
            tr = h.tracks[s]
            if k == 0:
                assert torch.equal(pool.state[d], pool.state[s])
            close(pool.state[d], tr.canon[tr.committed - tr.m + k])
        keep = [s for s in range(8) if s not in spare]
        assert torch.equal(pool.state[keep], saved.state[keep])
        assert all(torch.equal(u, v) for u, v in zip(pool.tensors()[1:], saved.tensors()[1:], strict=True))
    h.check_untouched()


def test_materialize_in_place_then_reset_continues_exactly() -> None:
    """align mode: the live slot folds all its history (n == history), its cursors are zeroed, decode goes on."""
    h = Harness(SHAPES[0], 5, 4, real=[1, 2], num_slots=3, seed=9)
    pool = h.pool
    for it in range(24):
        h.step()
        if it % 6 == 5:
            src = torch.tensor(h.real)
            rs = torch.tensor([h.tracks[s].start for s in h.real], dtype=I32)
            ns = torch.tensor([h.tracks[s].m for s in h.real], dtype=I32)
            replay_materialize_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, h.p.A, src, src, rs, ns)
            replay_reset_slot_ref(*pool.cursors(), src)
            for s in h.real:
                h.tracks[s].start = h.tracks[s].m = 0
                h.check_track(s)
    h.check_untouched()


def test_copy_slot_and_reset_slot() -> None:
    h = Harness(SHAPES[1], 5, 2, real=[], num_slots=6, seed=5)
    pool, saved = h.pool, h.pool.clone()
    pool.history[3] = 4
    saved.history[3] = 4
    replay_copy_slot_ref(pool.x_ring, pool.dt_ring, pool.B_ring, *pool.cursors(),
                         torch.tensor([1, 2, -1, 4, 5]), torch.tensor([2, 1, 3, -1, 5]))
    rings_and_cursors = list(zip(pool.tensors()[1:], saved.tensors()[1:], strict=True))
    for d, s in [(1, 2), (2, 1), (0, 0), (4, 4), (5, 5)]:  # a swap, a skipped dst, a continuing slot
        assert all(torch.equal(u[d], v[s]) for u, v in rings_and_cursors)
    assert (int(pool.ring_start[3]), int(pool.history[3]), bool(pool.is_flush[3])) == (0, 0, False)  # fresh
    assert all(torch.equal(u[3], v[3]) for u, v in rings_and_cursors[:3])
    assert torch.equal(pool.state, saved.state)

    saved = pool.clone()
    replay_reset_slot_ref(*pool.cursors(), torch.tensor([0, -1, 4]))
    for t in pool.cursors():
        assert not t[[0, 4]].any()
    for u, v in zip(pool.tensors(), saved.tensors(), strict=True):
        assert torch.equal(u[[1, 2, 3, 5]], v[[1, 2, 3, 5]])
    assert all(torch.equal(u, v) for u, v in zip(pool.tensors()[:4], saved.tensors()[:4], strict=True))


def test_shape_and_cursor_validation() -> None:
    h = Harness(SHAPES[1], 2, 2, real=[0], num_slots=2, seed=1)
    pool, p = h.pool, h.p
    H, P, N, G = SHAPES[1]
    slots, ntok = torch.tensor([0]), torch.tensor([1], dtype=I32)

    def step(T: int, **kw: torch.Tensor) -> None:
        a = {"x": h.randn(1, T, H, P), "dt": h.randn(1, T, H), "B": h.randn(1, T, G, N), "C": h.randn(1, T, G, N)}
        a.update(kw)
        replay_step_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, *pool.cursors(), slots, ntok,
                        a["x"], a["dt"], p.A, a["B"], a["C"], p.D, p.dt_bias)

    with pytest.raises(ValueError, match="W \\+ T"):
        step(3)  # R = 4 cannot hold W >= T = 3
    with pytest.raises(ValueError, match="C must be"):
        step(2, C=h.randn(1, 2, G, N + 1))
    with pytest.raises(ValueError, match="ring shapes"):
        replay_step_ref(pool.state, pool.x_ring[:, :, :3], pool.dt_ring, pool.B_ring, *pool.cursors(), slots, ntok,
                        h.randn(1, 2, H, P), h.randn(1, 2, H), p.A, h.randn(1, 2, G, N), h.randn(1, 2, G, N), p.D,
                        p.dt_bias)
    pool.history[0] = 3  # > W = 2
    with pytest.raises(ValueError, match="history"):
        step(2)
    with pytest.raises(ValueError, match="distinct"):
        replay_prepare_ref(*pool.cursors(), torch.tensor([1, 1]), torch.ones(2, dtype=I32),
                           torch.zeros(2, dtype=torch.bool), 2)
    with pytest.raises(ValueError, match="n="):
        replay_materialize_ref(pool.state, pool.x_ring, pool.dt_ring, pool.B_ring, p.A, slots, torch.tensor([1]),
                               torch.tensor([0], dtype=I32), torch.tensor([4], dtype=I32))
