"""Linears over one input run as one projection: their weights become row slices of one stacked
tensor, so a step launches one GEMV (or GEMM) where it launched one per Linear (attention's q, k and
v; a SwiGLU MLP's gate and up).

Each Linear keeps its own parameter under its checkpoint name, a view of the stack: the state dict,
tensor-parallel slicing and in-place loads see the Linears as before. The stack is made once, when
the model's weights are final (`prepare_weights_` after a load), never during a forward: a CUDA graph
captured on the separate weights would read freed memory if a later forward restacked them. Where
the parameters stopped being views of the stack (moved, cast, replaced), the forward runs the
Linears one by one.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from replayserve.layers.linear import Linear
from replayserve.ops.gemv import linear


class StackedProjection:
    """Linears of one input and dtype stacked by `stack_`; calling it gives their outputs."""

    def __init__(self, *linears: nn.Module) -> None:
        self.linears = linears
        self.sizes = [m.weight.shape[0] for m in linears]
        self._stack: tuple[Tensor, Tensor | None] | None = None

    def stack_(self) -> bool:
        """Makes every Linear's weight (and bias) a view of one (sum of outputs, in) tensor; False,
        and nothing changed, where they cannot stack: not all plain `Linear`s (FP8 ones keep per-tensor
        scales), of one dtype, device and input width, with biases on all or none."""
        weights = [m.weight for m in self.linears]
        biases = [m.bias for m in self.linears]
        if (not all(type(m) is Linear for m in self.linears) or len({(w.dtype, w.device, w.shape[1]) for w in weights})
                != 1 or weights[0].is_meta or len({b is None for b in biases}) != 1):
            return False
        with torch.no_grad():
            weight = torch.cat([w.detach() for w in weights])
            bias = None if biases[0] is None else torch.cat([b.detach() for b in biases])
            start = 0
            for m, size in zip(self.linears, self.sizes, strict=True):
                m.weight.data = weight[start : start + size]
                if bias is not None:
                    m.bias.data = bias[start : start + size]
                start += size
        self._stack = (weight, bias)
        return True

    def _stacked(self) -> tuple[Tensor, Tensor | None] | None:
        """The stack while the first and last Linears' weights are still its views, else None."""
        if self._stack is None:
            return None
        weight = self._stack[0]
        first, last = self.linears[0].weight, self.linears[-1].weight
        if first.data_ptr() != weight.data_ptr() or last.data_ptr() != weight[-self.sizes[-1] :].data_ptr():
            return None
        return self._stack

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        """x (T, in) -> each Linear's (T, out_i), views of one (T, sum out) output where stacked."""
        stacked = self._stacked()
        if stacked is None:
            return tuple(m(x) for m in self.linears)
        return tuple(linear(x, *stacked).split(self.sizes, dim=-1))
