"""Triton ReplaySSM kernels against the float64 ``replay_*_ref`` ops and the token-by-token recurrence.

Each drive runs prepare -> step -> commit for ``3W + 5`` steps on a small slot pool whose slots
start at random ring origins with staggered histories, so rows flush on different steps and the
ring wraps. Rows come in random order with a padded row and, for T > 1, random lengths, random
acceptance (rejected and padded tokens carry large garbage) and zero-accept rows. Every few
steps a materialization folds a random prefix of a live slot's history into a free slot.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from replayserve.ops import replay_ssm as ref
from replayserve.ops import replay_ssm_triton as tk

F64 = torch.float64
CUDA = torch.cuda.is_available()
DEVICES = ["cuda"] if CUDA else ["cpu"]
SMALL, BIG = (8, 16, 16, 2), (128, 64, 128, 8)  # (H, P, N, G)
TOL = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (6e-2, 2e-1)}  # (rtol, atol) against float64
POOL, LIVE = 6, 3  # slots in the pool; live requests (the rest are free: materialize targets)

# (window W, tokens T, dt_limit)
DRIVES = [(1, 1, (0.0, math.inf)), (4, 1, (0.05, 1.5)), (4, 4, (0.0, math.inf))]
# In the interpreter the W = 4 drives take 20-30 s each: slow there (the GPU runs them all quickly).
CASES = [pytest.param(DRIVES[i], SMALL, torch.float32, id=f"W{DRIVES[i][0]}-T{DRIVES[i][1]}-small-f32",
                      marks=[pytest.mark.slow] if i and not CUDA else [])
         for i in range(len(DRIVES))]
if CUDA:
    CASES += [pytest.param(d, shape, dt, id=f"W{d[0]}-T{d[1]}-{name}-{str(dt)[6:]}")
              for d in [(16, 1, (0.0, math.inf)), (32, 1, (0.0, math.inf)), (16, 4, (0.0, math.inf))] + DRIVES[1:]
              for shape, name in [(SMALL, "small"), (BIG, "big")]
              for dt in (torch.float32, torch.bfloat16)]


@dataclass
class Request:
    """One live sequence in float64: canonical states after 0..c committed tokens, and their inputs."""

    slot: int
    states: list[Tensor]
    inputs: list[tuple[Tensor, Tensor, Tensor]] = field(default_factory=list)  # (x (H,P), delta (H,), B (G,N))

    @property
    def committed(self) -> int:
        return len(self.states) - 1


class Drive:
    def __init__(self, device: str, shape: tuple[int, int, int, int], act: torch.dtype, window: int, tokens: int,
                 dt_limit: tuple[float, float], seed: int) -> None:
        self.H, self.P, self.N, self.G = shape
        self.W, self.T, self.R, self.dt_limit = window, tokens, window + tokens, dt_limit
        self.device, self.act = device, act
        self.gen = torch.Generator().manual_seed(seed)
        H, P, N, G, R = self.H, self.P, self.N, self.G, self.R
        self.A = -torch.exp(self.randn(H) * 0.5) * 0.5
        self.D, self.dt_bias = self.randn(H), self.randn(H) * 0.5
        # Kernel tensors (fp32 state, act-dtype x/B rings, fp32 delta ring) and the reference's float64 mirror.
        self.state = self.randn(POOL, H, P, N)
        self.x_ring, self.B_ring = self.randn(POOL, H, R, P).to(act), self.randn(POOL, G, R, N).to(act)
        self.dt_ring = self.rand(POOL, H, R)
        self.ring_start = torch.randint(0, R, (POOL,), generator=self.gen, dtype=torch.int32).to(device)
        self.history = torch.zeros(POOL, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(POOL, dtype=torch.bool, device=device)
        slots = torch.randperm(POOL, generator=self.gen)[:LIVE].tolist()
        self.requests = [Request(s, [self.state[s].double()]) for s in slots]
        for req in self.requests:  # staggered histories: prefilled, committed ring entries
            for _ in range(int(torch.randint(0, window + 1, (1,), generator=self.gen))):
                x, delta, b = self.randn(H, P).to(act), self.rand(H), self.randn(G, N).to(act)
                phys = (int(self.ring_start[req.slot]) + int(self.history[req.slot])) % R
                self.x_ring[req.slot, :, phys], self.dt_ring[req.slot, :, phys] = x, delta
                self.B_ring[req.slot, :, phys] = b
                self.history[req.slot] += 1
                self.commit_token(req, x.double(), delta.double(), b.double())
        self.mirror = [t.double() if t.is_floating_point() else t.clone() for t in self.kernel_tensors()]

    def randn(self, *size: int) -> Tensor:
        return torch.randn(*size, generator=self.gen).to(self.device)

    def rand(self, *size: int) -> Tensor:
        return (torch.rand(*size, generator=self.gen) + 0.05).to(self.device)

    def kernel_tensors(self) -> list[Tensor]:
        return [self.state, self.x_ring, self.dt_ring, self.B_ring, self.ring_start, self.history, self.is_flush]

    def commit_token(self, req: Request, x: Tensor, delta: Tensor, b: Tensor) -> None:
        rep = self.H // self.G
        bh = b.repeat_interleave(rep, 0)
        decay = torch.exp(delta * self.A.double())[:, None, None]
        s = decay * req.states[-1] + (delta[:, None] * x)[..., None] * bh[:, None]
        req.states.append(s)
        req.inputs.append((x, delta, b))

    def snapshot(self, slots: list[int]) -> list[Tensor]:
        return [t[slots].clone() for t in self.kernel_tensors()]

    def check_slot(self, req: Request, rtol: float, atol: float) -> None:
        """Checkpoint == canonical state at committed - history; ring entries == committed inputs."""
        s = req.slot
        m, start = int(self.history[s]), int(self.ring_start[s])
        assert 0 <= m <= self.W and 0 <= start < self.R
        torch.testing.assert_close(self.state[s].double(), req.states[req.committed - m], rtol=rtol, atol=atol)
        for j in range(m):
            phys = (start + j) % self.R
            x, delta, b = req.inputs[req.committed - m + j]
            assert torch.equal(self.x_ring[s, :, phys].double(), x)
            assert torch.equal(self.B_ring[s, :, phys].double(), b)
            torch.testing.assert_close(self.dt_ring[s, :, phys].double(), delta, rtol=1e-5, atol=1e-6)

    def step(self, index: int, rtol: float, atol: float) -> None:
        H, P, N, G, T, dev, rep = self.H, self.P, self.N, self.G, self.T, self.device, self.H // self.G
        reqs = [self.requests[i] for i in torch.randperm(LIVE, generator=self.gen).tolist()]
        rows: list[Request | None] = list(reqs)
        rows.insert(int(torch.randint(0, LIVE + 1, (1,), generator=self.gen)), None)  # a padded row
        n = [1 if T == 1 else int(torch.randint(1, T + 1, (1,), generator=self.gen)) for _ in rows]
        sit_out = [r is not None and T > 1 and float(torch.rand(1, generator=self.gen)) < 0.15 for r in rows]
        fresh = [False] * len(rows)
        if index == 2 * self.W:  # recycle one slot: a new request with a canonical (prefilled) state
            i = rows.index(reqs[0])
            fresh[i] = True
            new_state = self.randn(H, P, N)
            self.state[reqs[0].slot] = new_state
            self.mirror[0][reqs[0].slot] = new_state.double()
            reqs[0].states, reqs[0].inputs = [new_state.double()], []
        slots = torch.tensor([-1 if r is None else r.slot for r in rows], device=dev)
        ntok = torch.tensor(n, dtype=torch.int32, device=dev)
        fresh_t = torch.tensor(fresh, device=dev)
        x = self.randn(len(rows), T, H, P)
        dt = self.randn(len(rows), T, H)
        B, C = self.randn(len(rows), T, G, N), self.randn(len(rows), T, G, N)
        for i, k in enumerate(n):  # tokens past n (and padded rows) are garbage the kernel must ignore
            if rows[i] is None:
                k = 0
            x[i, k:] *= 100.0
            B[i, k:] *= 100.0
            C[i, k:] *= 100.0
            dt[i, k:] += 5.0
        x, B, C, dt = x.to(self.act), B.to(self.act), C.to(self.act), dt.to(self.act)
        free = [s for s in range(POOL) if s not in {r.slot for r in self.requests}]
        untouched = self.snapshot(free)

        tk.replay_prepare_triton(self.ring_start, self.history, self.is_flush, slots, ntok, fresh_t, self.W)
        ref.replay_prepare_ref(*self.mirror[4:], slots, ntok, fresh_t, self.W)
        for got, want in zip(self.kernel_tensors()[4:], self.mirror[4:], strict=True):
            assert torch.equal(got, want)
        for i, r in enumerate(rows):  # host mirror of the flush predicate, with each row's own n
            if r is not None:
                assert bool(self.is_flush[r.slot]) == (int(self.history[r.slot]) + n[i] > self.W)

        run = slots.clone()
        run[torch.tensor(sit_out, device=dev)] = -1  # zero-accept rows hold a slot but run nothing
        args = (run, ntok, x, dt, self.A, B, C, self.D, self.dt_bias, self.dt_limit)
        y = tk.replay_step_triton(*self.kernel_tensors(), *args)
        y_ref = ref.replay_step_ref(*self.mirror, run, ntok, x.double(), dt.double(), self.A.double(), B.double(),
                                    C.double(), self.D.double(), self.dt_bias.double(), self.dt_limit)
        for i, r in enumerate(rows):
            if r is None or sit_out[i]:
                assert not y[i].any()
                continue
            torch.testing.assert_close(y[i, : n[i]].double(), y_ref[i, : n[i]], rtol=rtol, atol=atol)
            assert not y[i, n[i]:].any()
            delta = F.softplus(dt[i].double() + self.dt_bias.double()).clamp(*self.dt_limit)
            s = r.states[-1]
            for t in range(n[i]):  # the recurrence, continued from the canonical state
                bh, ch = B[i, t].double().repeat_interleave(rep, 0), C[i, t].double().repeat_interleave(rep, 0)
                s = torch.exp(delta[t] * self.A.double())[:, None, None] * s
                s = s + (delta[t, :, None] * x[i, t].double())[..., None] * bh[:, None]
                y_t = torch.einsum("hpn,hn->hp", s, ch) + self.D.double()[:, None] * x[i, t].double()
                torch.testing.assert_close(y[i, t].double(), y_t, rtol=rtol, atol=atol)

        acc = [0 if s_o else (1 if r is None else int(torch.randint(1, k + 1, (1,), generator=self.gen)))
               for r, k, s_o in zip(rows, n, sit_out, strict=True)]
        acc_t = torch.tensor(acc, dtype=torch.int32, device=dev)
        tk.replay_commit_triton(self.ring_start, self.history, self.is_flush, slots, acc_t, self.R)
        ref.replay_commit_ref(*self.mirror[4:], slots, acc_t, self.R)
        for got, want in zip(self.kernel_tensors(), self.mirror, strict=True):
            if got.is_floating_point():
                torch.testing.assert_close(got.double(), want, rtol=rtol, atol=atol)
            else:
                assert torch.equal(got, want)
        for i, r in enumerate(rows):
            if r is not None and not sit_out[i]:
                delta = F.softplus(dt[i].double() + self.dt_bias.double()).clamp(*self.dt_limit)
                for t in range(acc[i]):
                    self.commit_token(r, x[i, t].double(), delta[t], B[i, t].double())
        for r in self.requests:
            self.check_slot(r, rtol, atol)
        for got, want in zip(self.snapshot(free), untouched, strict=True):
            assert torch.equal(got, want)
        if index % 3 == 2:
            self.materialize(free, rtol, atol)

    def materialize(self, free: list[int], rtol: float, atol: float) -> None:
        """Fold a random prefix (n = 0 for the first row: an exact copy) of live histories into free slots."""
        src_reqs = self.requests[:2]
        n = [0] + [int(torch.randint(0, int(self.history[r.slot]) + 1, (1,), generator=self.gen)) for r in src_reqs[1:]]
        src = torch.tensor([r.slot for r in src_reqs] + [-1], device=self.device)
        dst = torch.tensor(free[:2] + [-1], device=self.device)
        start = torch.cat([self.ring_start[src[:2]], torch.zeros(1, dtype=torch.int32, device=self.device)])
        n_t = torch.tensor(n + [0], dtype=torch.int32, device=self.device)
        before = self.snapshot(src[:2].tolist())
        untouched = self.snapshot(free[2:])
        tk.replay_materialize_triton(*self.kernel_tensors()[:4], self.A, src, dst, start, n_t)
        ref.replay_materialize_ref(*self.mirror[:4], self.A.double(), src, dst, start, n_t)
        for got, want in zip(self.snapshot(src[:2].tolist()) + self.snapshot(free[2:]), before + untouched,
                             strict=True):
            assert torch.equal(got, want)
        assert torch.equal(self.state[dst[0]], self.state[src[0]])  # n == 0: bitwise copy
        for k, r in enumerate(src_reqs):
            target = r.states[r.committed - int(self.history[r.slot]) + n[k]]
            torch.testing.assert_close(self.state[dst[k]].double(), target, rtol=rtol, atol=atol)
            torch.testing.assert_close(self.state[dst[k]].double(), self.mirror[0][dst[k]], rtol=rtol, atol=atol)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("drive", "shape", "act"), CASES)
def test_replay_drive(device: str, drive: tuple[int, int, tuple[float, float]], shape: tuple[int, int, int, int],
                      act: torch.dtype) -> None:
    window, tokens, dt_limit = drive
    d = Drive(device, shape, act, window, tokens, dt_limit, seed=window * 10 + tokens)
    rtol, atol = TOL[act]
    steps = 3 * window + 5 if device == "cpu" else max(3 * window + 5, 40)
    for i in range(steps):
        d.step(i, rtol, atol)


@pytest.mark.parametrize("device", DEVICES)
def test_wrap_is_exact_on_non_power_of_two_ring(device: str) -> None:
    """R = 20: (18 + 5) mod 20 = 3, where a bitmask would give 19 (design §3.4)."""
    ring_start = torch.tensor([18], dtype=torch.int32, device=device)
    history = torch.tensor([5], dtype=torch.int32, device=device)
    is_flush = torch.tensor([True], device=device)
    slots = torch.tensor([0], device=device)
    tk.replay_commit_triton(ring_start, history, is_flush, slots, torch.tensor([2], dtype=torch.int32,
                                                                                device=device), 20)
    assert ring_start.tolist() == [3] and history.tolist() == [2]

