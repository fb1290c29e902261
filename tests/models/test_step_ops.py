"""A batch-1 decode step's kernels per layer, per family (benchmarks/count_step_ops.py, CPU, tiny
models), stay under a pinned bound: a regression that adds per-step elementwise work (a multiplier
applied at runtime, RoPE angles per layer, an unfused norm, activation or residual add, a routing in
PyTorch ops) fails here. Two counts: the aten ops the CPU references dispatch, and the CUDA path's
(the ops' Triton kernels, interpreted, and the aten ops around them).

Measured at this commit, kernels per layer (a Granite or Bamba layer is a mixer and its
feed-forward half, a Falcon-H1 layer two mixers and an MLP, a Nemotron-H layer one of them; a Qwen
layer a Gated DeltaNet or gated attention mixer and its MoE, Qwen3-Next's first a dense MLP):

    CUDA path:  Nemotron-H 6.0, Granite 15.3 (48.5 before), Bamba 10.3 (23.5), Falcon-H1 16.7 (57.0),
                Qwen3-Next 28.5 (48.2), Qwen3.5-MoE 30.8 (56.8)
    references: Nemotron-H 38.0, Granite 84.5 (90.0), Bamba 59.2 (65.0), Falcon-H1 100.7 (120.7),
                Qwen3-Next 101.2 (105.2), Qwen3.5-MoE 109.2 (114.2)

("before": main at 1b44341, the multipliers applied at runtime, RoPE per layer in PyTorch ops,
Granite's experts by the per-expert loop or dense over all experts, q/k/v and gate/up unstacked;
for Qwen main at 608d6a2, its experts by the per-expert loop (this count's CPU proxy; on CUDA they
ran dense over all E experts, 16 + 6 E kernels a MoE layer at batch 1, now 9), the router, the
shared expert's gate and its gate/up projections apart.)
The bounds leave under one kernel per layer of room.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from count_step_ops import ops_per_layer  # noqa: E402

BOUNDS = {  # family: (CUDA path, references)
    "nemotron_h": (6.5, 39.0), "granite": (16.0, 85.5), "bamba": (11.0, 60.5), "falcon_h1": (17.5, 102.0),
    "qwen3_next": (29.0, 102.0), "qwen3_5_moe": (31.5, 110.0),
}


@pytest.mark.parametrize("kernels", [True, False], ids=["cuda-path", "references"])
@pytest.mark.parametrize("family", list(BOUNDS))
def test_decode_step_kernels_per_layer_stay_under_the_bound(family: str, kernels: bool, tmp_path: Path) -> None:
    if kernels and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels' count runs them in Triton's interpreter (TRITON_INTERPRET=1, tests/conftest.py)")
    per_layer, ops = ops_per_layer(family, tmp_path, kernels)
    assert ops["aten::linear"] > 0  # the counter saw the forward
    if kernels:
        assert any(name.startswith("triton:") for name in ops)
    bound = BOUNDS[family][0 if kernels else 1]
    assert per_layer <= bound, f"{family}: {per_layer:.1f} kernels/layer > {bound}: {ops.most_common(12)}"
