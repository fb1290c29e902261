"""The baseline Gated DeltaNet backend against one pass of the conv and the delta rule over the whole
sequence (float64): chunked prefill with boundary captures, decode, a speculative verify committing
each row's accepted prefix, boundary publication inside a verify, slot copies and resets, and the
state dtypes of the layout."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.conv1d import causal_conv1d_ref
from replayserve.ops.gated_delta import gated_delta_recurrent_ref
from replayserve.ssm.gated_delta_baseline import GatedDeltaBaselineBackend
from replayserve.ssm.layout import GatedDeltaLayout

F64 = torch.float64


def _layout(tokens_per_step: int = 1, dtype: torch.dtype = F64) -> GatedDeltaLayout:
    return GatedDeltaLayout(num_layers=2, num_slots=10, num_key_heads=2, num_value_heads=4, key_dim=8, value_dim=6,
                            conv_kernel=4, act_dtype=dtype, state_dtype=F64 if dtype == F64 else torch.float32,
                            tokens_per_step=tokens_per_step)


def _inputs(layout: GatedDeltaLayout, length: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(length, layout.conv_dim, generator=gen, dtype=F64)
    g = -torch.rand(length, layout.num_value_heads, generator=gen, dtype=F64)
    beta = torch.rand(length, layout.num_value_heads, generator=gen, dtype=F64)
    weight = torch.randn(layout.conv_dim, layout.conv_kernel, generator=gen, dtype=F64) * 0.5
    return qkv, g, beta, weight


def _reference(layout: GatedDeltaLayout, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One pass from zero state: o (L, Hv, V), the final conv state and recurrent state."""
    mixed, conv = causal_conv1d_ref(qkv, weight, None)
    q, k, v = layout.split_qkv(mixed)
    o, state = gated_delta_recurrent_ref(q[None], k[None], v[None], g[None], beta[None], use_qk_l2norm=True)
    return o[0], conv, state[0]


def test_chunked_prefill_with_captures_and_decode_equal_one_pass() -> None:
    layout = _layout()
    backend = GatedDeltaBaselineBackend(layout, torch.device("cpu"))
    qkv, g, beta, weight = _inputs(layout, 23)
    slot, layer = 3, 1
    # Chunks of 9 and 10 tokens, captures inside each chunk and at a chunk's end, then 4 decodes.
    o1 = backend.prefill(layer, slot, qkv[:9], g[:9], beta[:9], weight, captures=((2, 5), (9, 6)))
    o2 = backend.prefill(layer, slot, qkv[9:19], g[9:19], beta[9:19], weight, captures=((7, 7),))
    decoded = [backend.decode(layer, torch.tensor([slot]), qkv[t : t + 1], g[t : t + 1], beta[t : t + 1], weight)
               for t in range(19, 23)]
    o_ref, conv_ref, state_ref = _reference(layout, qkv, g, beta, weight)
    torch.testing.assert_close(torch.cat([o1, o2, *decoded]), o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(backend.conv_state[layer][slot], conv_ref, rtol=0, atol=0)
    torch.testing.assert_close(backend.ssm_state[layer][slot], state_ref, rtol=1e-12, atol=1e-12)
    for dst, length in ((5, 2), (6, 9), (7, 16)):
        _, conv, state = _reference(layout, qkv[:length], g[:length], beta[:length], weight)
        torch.testing.assert_close(backend.conv_state[layer][dst], conv, rtol=0, atol=0)
        torch.testing.assert_close(backend.ssm_state[layer][dst], state, rtol=1e-12, atol=1e-12)
    assert not backend.ssm_state[0].any()  # the other layer's state is untouched


@pytest.mark.parametrize("accepted", [[1, 4], [3, 2]])
def test_verify_commits_each_rows_accepted_prefix_and_publishes_inside_it(accepted: list[int]) -> None:
    layout = _layout(tokens_per_step=4)
    backend = GatedDeltaBaselineBackend(layout, torch.device("cpu"))
    slots, prompt, width = torch.tensor([1, 2]), 6, 4
    rows = [_inputs(layout, prompt + width, seed) for seed in (1, 2)]
    weight = rows[0][3]
    for layer in range(layout.num_layers):
        for slot, (qkv, g, beta, _) in zip(slots.tolist(), rows, strict=True):
            backend.prefill(layer, slot, qkv[:prompt], g[:prompt], beta[:prompt], weight)
    backend.begin_step(slots, torch.tensor([width, width], dtype=torch.int32))
    stacked = [torch.stack([r[i][prompt:] for r in rows]) for i in range(3)]
    outs = [backend.verify(layer, slots, *stacked, torch.tensor([width, width], dtype=torch.int32), weight)
            for layer in range(layout.num_layers)]
    kept = torch.tensor(accepted, dtype=torch.int32)
    backend.end_step(slots, kept)
    # A boundary one token before the end of a row's committed tokens (inside the verify), into slot 8.
    row = next(b for b, n in enumerate(accepted) if n >= 2)
    backend.publish(torch.tensor([row]), slots[row : row + 1], torch.tensor([8]), torch.tensor([1], dtype=torch.int32),
                    [])
    for b, (qkv, g, beta, _) in enumerate(rows):
        o_ref, _, _ = _reference(layout, qkv, g, beta, weight)
        for layer in range(layout.num_layers):
            torch.testing.assert_close(outs[layer][b], o_ref[prompt:], rtol=1e-12, atol=1e-12)
        n = prompt + accepted[b]
        _, conv, state = _reference(layout, qkv[:n], g[:n], beta[:n], weight)
        torch.testing.assert_close(backend.conv_state[1][slots[b]], conv, rtol=0, atol=0)
        torch.testing.assert_close(backend.ssm_state[1][slots[b]], state, rtol=1e-12, atol=1e-12)
        if b == row:
            _, conv, state = _reference(layout, qkv[: n - 1], g[: n - 1], beta[: n - 1], weight)
            torch.testing.assert_close(backend.conv_state[0][8], conv, rtol=0, atol=0)
            torch.testing.assert_close(backend.ssm_state[0][8], state, rtol=1e-12, atol=1e-12)


def test_copy_and_reset_slots() -> None:
    layout = _layout()
    backend = GatedDeltaBaselineBackend(layout, torch.device("cpu"))
    qkv, g, beta, weight = _inputs(layout, 7)
    for layer in range(layout.num_layers):
        backend.prefill(layer, 0, qkv, g, beta, weight)
    backend.copy_slots(torch.tensor([0]), torch.tensor([4]))
    for t in (*backend.conv_state, *backend.ssm_state):
        assert t[0].any() and torch.equal(t[4], t[0])
    backend.reset_slots(torch.tensor([0, 4]))
    assert not any(t.any() for t in backend.state_tensors())


def test_layout_shapes_and_dtypes() -> None:
    layout = _layout(tokens_per_step=3, dtype=torch.bfloat16)
    backend = GatedDeltaBaselineBackend(layout, torch.device("cpu"))
    assert backend.conv_state[0].shape == (10, 2 * 2 * 8 + 4 * 6, 3) and backend.conv_state[0].dtype == torch.bfloat16
    assert backend.ssm_state[0].shape == (10, 4, 8, 6) and backend.ssm_state[0].dtype == torch.float32
    assert backend.spec_states[0].shape == (10, 3, 4, 8, 6)
    assert backend.memory_bytes() == 2 * (10 * 56 * 3 * 2 + 4 * 10 * 4 * 8 * 6 * 4)
