"""Boundary states a prefill chunk captures (prefix caching) equal the prefill of that prefix
alone, wherever the chunk starts on the SSD chunk grid (float64, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from replayserve.ssm.baseline import BaselineBackend
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.params import MambaParams

F64 = torch.float64
Q = 8  # SSD chunk size
LAYOUT = MambaLayout(num_layers=1, num_slots=12, num_heads=4, head_dim=4, state_size=8, n_groups=2, conv_kernel=4,
                     act_dtype=F64, state_dtype=F64)


def _params(gen: torch.Generator) -> MambaParams:
    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=gen, dtype=F64)

    h = LAYOUT.num_heads
    return MambaParams(conv_weight=randn(LAYOUT.conv_dim, LAYOUT.conv_kernel), conv_bias=randn(LAYOUT.conv_dim),
                       A=-torch.exp(randn(h)), D=randn(h), dt_bias=randn(h) * 0.5, dt_limit=(1e-3, math.inf),
                       chunk_size=Q)


def _prefill(backend: BaselineBackend, slot: int, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
             first: int, cuts: list[int], captures: dict[int, int]) -> torch.Tensor:
    """Prefills positions [first, len) in chunks ending at `cuts`; captures: position -> slot."""
    ys, lo = [], first
    for hi in [*cuts, xbc.shape[0]]:
        caps = tuple((p - lo, s) for p, s in sorted(captures.items()) if lo < p <= hi)
        ys.append(backend.prefill(0, slot, xbc[lo:hi], dt[lo:hi], params, caps, lo % Q))
        lo = hi
    return torch.cat(ys)


@pytest.mark.parametrize("cuts", [[], [13], [5, 21], [16]], ids=["one-chunk", "off-grid", "two-off-grid", "on-grid"])
def test_captured_states_equal_the_prefix_prefilled_alone(cuts: list[int]) -> None:
    gen = torch.Generator().manual_seed(len(cuts) * 10 + sum(cuts))
    params, length = _params(gen), 43
    xbc = torch.randn(length, LAYOUT.conv_dim, generator=gen, dtype=F64)
    dt = torch.randn(length, LAYOUT.num_heads, generator=gen, dtype=F64)
    # Grid points (on the chunk grid: one scan) and off it (a split), and the end of a chunk.
    captures = {8: 1, 16: 2, 20: 3, 24: 4, 40: 5, 43: 6}
    if cuts:
        captures[cuts[0]] = 7
    backend = BaselineBackend(LAYOUT, torch.device("cpu"))
    y = _prefill(backend, 0, xbc, dt, params, 0, cuts, captures)
    whole = BaselineBackend(LAYOUT, torch.device("cpu"))
    y_whole = whole.prefill(0, 0, xbc, dt, params)
    assert (y - y_whole).abs().max() <= 1e-10 * y_whole.abs().max()
    for position, slot in captures.items():
        alone = BaselineBackend(LAYOUT, torch.device("cpu"))
        alone.prefill(0, 0, xbc[:position], dt[:position], params)
        for got, want in ((backend.conv_state[0][slot], alone.conv_state[0][0]),
                          (backend.ssm_state[0][slot], alone.ssm_state[0][0])):
            assert (got - want).abs().max() <= 1e-10 * want.abs().max(), f"state at {position}"
