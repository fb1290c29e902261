"""The ReplaySSM Gated DeltaNet backend against the baseline one: the same random drive of prefills
with captures, plain decode steps and speculative verifies with random acceptance, through many
flushes (window 4), gives the same outputs, the same conv states, and materialized boundary states
(published mid-verify and at a step's end) equal to the baseline's live and published states; a
prefix hit's copy and a live slot's copy continue equally; resets clear rings and cursors. In float64 on the reference
ops, and in float32 on the kernels (Triton's interpreter on a CPU), where both backends take the
fixed-shape path's pad slot. The baseline itself is held to the one-pass recurrence in
test_gated_delta_baseline.py."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from replayserve.config import ConfigError
from replayserve.ops.dispatch import force_triton
from replayserve.ssm.gated_delta_baseline import GatedDeltaBaselineBackend
from replayserve.ssm.gated_delta_replay import GatedDeltaReplayBackend
from replayserve.ssm.layout import GatedDeltaLayout

F64 = torch.float64
CPU = torch.device("cpu")
TOL = {"rtol": 1e-10, "atol": 1e-10}


def _layout(window: int = 4, tokens_per_step: int = 3, dtype: torch.dtype = F64) -> GatedDeltaLayout:
    return GatedDeltaLayout(num_layers=2, num_slots=12, num_key_heads=2, num_value_heads=4, key_dim=8, value_dim=6,
                            conv_kernel=4, act_dtype=dtype, state_dtype=dtype, tokens_per_step=tokens_per_step,
                            window=window)


def _tokens(layout: GatedDeltaLayout, shape: tuple[int, ...], gen: torch.Generator,
            device: torch.device = CPU) -> tuple[torch.Tensor, ...]:
    """qkv (*shape, conv_dim), g and beta (*shape, Hv): the mixer's inputs, drawn on the CPU."""
    qkv = torch.randn(*shape, layout.conv_dim, generator=gen, dtype=F64)
    g = -torch.rand(*shape, layout.num_value_heads, generator=gen, dtype=F64)
    beta = torch.rand(*shape, layout.num_value_heads, generator=gen, dtype=F64)
    return tuple(t.to(device, layout.act_dtype) for t in (qkv, g, beta))


def _pair(layout: GatedDeltaLayout, device: torch.device = CPU) -> tuple[GatedDeltaBaselineBackend,
                                                                         GatedDeltaReplayBackend]:
    return (GatedDeltaBaselineBackend(dataclasses.replace(layout, window=0), device),
            GatedDeltaReplayBackend(layout, device))


def _assert_states_equal(base: GatedDeltaBaselineBackend, replay: GatedDeltaReplayBackend, slots: list[int],
                         tol: dict[str, float]) -> None:
    """The baseline's state of `slots` equals the replay backend's canonical one (materialized into slot 9)."""
    device = replay.ssm_state[0].device
    pad = torch.tensor([9], device=device)
    for s in slots:
        src = torch.tensor([s], device=device)
        replay.publish(torch.tensor([0], device=device), src, pad, torch.tensor([0], dtype=torch.int32, device=device),
                       [])
        for layer in range(base.layout.num_layers):
            torch.testing.assert_close(replay.conv_state[layer][s], base.conv_state[layer][s], rtol=0, atol=0)
            torch.testing.assert_close(replay.ssm_state[layer][pad[0]], base.ssm_state[layer][s], **tol)


@pytest.mark.parametrize(("seed", "kernels"), [(0, False), (1, False), (2, False), (0, True)],
                         ids=["ref0", "ref1", "ref2", "kernels"])
def test_replay_equals_baseline_through_flushes_verifies_and_publishes(seed: int, kernels: bool) -> None:
    # The kernels run on the GPU where there is one, else in Triton's interpreter on CPU tensors.
    device = torch.device("cuda") if kernels and torch.cuda.is_available() else CPU
    with force_triton() if kernels else contextlib.nullcontext():
        # Fewer steps on the kernels: the interpreter is slow.
        _drive(seed, _layout(dtype=torch.float32 if kernels else F64), {"rtol": 2e-4, "atol": 2e-4} if kernels else TOL,
               steps=6 if kernels else 14, device=device)


def _drive(seed: int, layout: GatedDeltaLayout, tol: dict[str, float], steps: int, device: torch.device) -> None:
    base, replay = _pair(layout, device)
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(layout.conv_dim, layout.conv_kernel, generator=gen, dtype=F64)
    weight = weight.to(device, layout.act_dtype) * 0.5
    live, boundary = [0, 1, 2], iter(range(3, 11))
    # One packed prefill step of the three sequences, with a capture inside one and at another's end.
    lens = [5, 9, 3]
    qkv, g, beta = _tokens(layout, (sum(lens),), gen, device)
    cuts = [0, 5, 14, 17]
    segments = [(cuts[i], cuts[i + 1], live[i], caps, 0)
                for i, caps in enumerate((((5, next(boundary)),), ((4, next(boundary)),), ()))]
    for layer in range(layout.num_layers):
        o_base = base.prefill_batch(layer, segments, qkv, g, beta, weight)
        o_replay = replay.prefill_batch(layer, segments, qkv, g, beta, weight)
        torch.testing.assert_close(o_replay, o_base, rtol=0, atol=0)  # one shared prefill
    # On the kernels, a fourth row on the pad slot, as the fixed-shape path pads (the references need
    # distinct slots, so they skip it: the float64 drive runs three rows).
    pad = [layout.num_slots - 1] if layout.act_dtype != F64 else []
    slots = torch.tensor(live + pad, device=device)
    rows = len(live + pad)
    flushes = 0
    for step in range(steps):
        verify = step % 3 != 2
        n = (torch.randint(1, layout.tokens_per_step + 1, (rows,), generator=gen, dtype=torch.int32) if verify
             else torch.ones(rows, dtype=torch.int32)).to(device)
        # begin_step and the graphed plain decode's end_step take the rows' slots, -1 on padded rows.
        row_slots = slots.masked_fill(slots == layout.num_slots - 1, -1)
        for backend in (base, replay):
            backend.begin_step(row_slots, n)
        flushes += int(replay.is_flush[live].sum())
        width = layout.tokens_per_step if verify else 1
        qkv, g, beta = _tokens(layout, (rows, width), gen, device)
        for layer in range(layout.num_layers):
            if verify:
                o_base = base.verify(layer, slots, qkv, g, beta, n, weight)
                o_replay = replay.verify(layer, slots, qkv, g, beta, n, weight)
                for row in range(3):
                    torch.testing.assert_close(o_replay[row, : n[row]], o_base[row, : n[row]], **tol)
            else:
                o_base = base.decode(layer, slots, qkv[:, 0], g[:, 0], beta[:, 0], weight)
                torch.testing.assert_close(replay.decode(layer, slots, qkv[:, 0], g[:, 0], beta[:, 0], weight)[:3],
                                           o_base[:3], **tol)
        kept = ((torch.rand(rows, generator=gen) * n.cpu()).floor().int() + 1).to(device)  # 1..n: rollback of the rest
        for backend in (base, replay):  # the runner's eager end_step: the real rows
            backend.end_step(slots[:3], kept[:3])
        # A boundary `lag` tokens before a row's end, inside this step's kept tokens, on both.
        row = int(torch.randint(0, 3, (1,), generator=gen))
        lag = torch.randint(0, int(kept[row]), (1,), generator=gen, dtype=torch.int32).to(device)
        dst = torch.tensor([8 if step % 2 else 10], device=device)
        for backend in (base, replay):
            backend.publish(torch.tensor([row], device=device), slots[row : row + 1], dst, lag, [])
        for layer in range(layout.num_layers):
            torch.testing.assert_close(replay.conv_state[layer][dst], base.conv_state[layer][dst], rtol=0, atol=0)
            torch.testing.assert_close(replay.ssm_state[layer][dst], base.ssm_state[layer][dst], **tol)
        _assert_states_equal(base, replay, live, tol)
    assert flushes >= steps // 2  # window 4: the drive crosses many flushes
    # A prefix hit copies a prefill capture (canonical) and continues equally; a live slot with
    # history copies whole too (checkpoint, rings and cursors together).
    assert int(replay.history[1]) > 0
    copies = torch.tensor([[4, 7], [1, 6]], device=device)
    for backend in (base, replay):
        backend.copy_slots(copies[:, 0], copies[:, 1])
    assert int(replay.history[7]) == 0 and int(replay.history[6]) == int(replay.history[1])
    slots, ones = copies[:, 1], torch.ones(2, dtype=torch.int32, device=device)
    for _ in range(3):  # past the copied history's flush
        qkv, g, beta = _tokens(layout, (2,), gen, device)
        for backend in (base, replay):
            backend.begin_step(slots, ones)
        for layer in range(layout.num_layers):
            torch.testing.assert_close(replay.decode(layer, slots, qkv, g, beta, weight),
                                       base.decode(layer, slots, qkv, g, beta, weight), **tol)
        for backend in (base, replay):
            backend.end_step(slots, ones)
    _assert_states_equal(base, replay, [7, 6], tol)


def test_fixed_shape_rows_on_the_pad_slot_touch_no_live_slot() -> None:
    """The CUDA-graph path pads a step's rows with the pad slot: real rows equal an unpadded step."""
    layout = _layout()
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(layout.conv_dim, layout.conv_kernel, generator=gen, dtype=F64)
    qkv, g, beta = _tokens(layout, (2, 1), gen)
    pad = layout.num_slots - 1
    outs = []
    for slots, rows in ((torch.tensor([0, 1]), 2), (torch.tensor([0, 1, pad, pad]), 4)):
        replay = GatedDeltaReplayBackend(layout, CPU)
        q, gg, b = (torch.cat([t, t[:1].expand(rows - 2, *t.shape[1:])]) for t in (qkv, g, beta))
        n = torch.ones(rows, dtype=torch.int32)
        for _ in range(6):  # past the window: a flush with padded rows
            replay.begin_step(slots.masked_fill(slots == pad, -1), n)
            o = replay.decode(0, slots, q[:, 0], gg[:, 0], b[:, 0], weight)
            replay.end_step(slots.masked_fill(slots == pad, -1), n)
        outs.append((o[:2], replay.ssm_state[0][:2].clone(), replay.history[:2].clone()))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reset_clears_rings_and_cursors_and_the_window_is_checked() -> None:
    layout = _layout()
    _, replay = _pair(layout)
    gen = torch.Generator().manual_seed(3)
    weight = torch.randn(layout.conv_dim, layout.conv_kernel, generator=gen, dtype=F64)
    slots, n = torch.tensor([0, 1]), torch.ones(2, dtype=torch.int32)
    qkv, g, beta = _tokens(layout, (2,), gen)
    replay.begin_step(slots, n)
    replay.decode(0, slots, qkv, g, beta, weight)
    replay.end_step(slots, n)
    assert replay.history[:2].tolist() == [1, 1] and replay.k_ring[0][:2].any()
    replay.reset_slots(slots)
    assert not any(t.any() for t in replay.state_tensors())
    assert replay.k_ring[0].shape == (12, 2, 7, 8) and replay.g_ring[0].shape == (12, 4, 7)
    with pytest.raises(ConfigError, match="replay_window: 2 must be in"):
        GatedDeltaReplayBackend(_layout(window=2), CPU)
