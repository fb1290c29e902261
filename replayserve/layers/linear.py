"""The projections' linear layer: ``nn.Linear`` (same parameters and checkpoint names) whose
forward is ``ops.gemv.linear``: the Triton GEMV for one half-precision row where the kernels
serve, ``F.linear`` (``nn.Linear``'s own forward) for every other input."""

from __future__ import annotations

from torch import Tensor, nn

from replayserve.ops.gemv import linear


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
