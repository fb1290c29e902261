"""A batch-1 decode step's aten ops per layer, per family (benchmarks/count_step_ops.py, CPU, tiny
models), stay under a pinned bound: a regression that adds per-step elementwise work (a multiplier
applied at runtime, RoPE angles per layer, an unfused norm or residual add) fails here.

Measured at this commit (float32, CPU references): Nemotron-H 39.8, Granite 88.5, Bamba 64.2,
Falcon-H1 107.7; before the multipliers were folded and RoPE's tables shared: 39.8 / 91.3 / 66.3 /
122.7. The bounds leave one or two ops of room."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from count_step_ops import ops_per_layer  # noqa: E402

BOUNDS = {"nemotron_h": 41.0, "granite": 90.0, "bamba": 66.0, "falcon_h1": 109.0}


@pytest.mark.parametrize("family", list(BOUNDS))
def test_decode_step_ops_per_layer_stay_under_the_bound(family: str, tmp_path: Path) -> None:
    per_layer, ops = ops_per_layer(family, tmp_path)
    assert ops["aten::linear"] > 0  # the counter saw the forward
    assert per_layer <= BOUNDS[family], f"{family}: {per_layer:.1f} ops/layer > {BOUNDS[family]}: {ops.most_common(12)}"
