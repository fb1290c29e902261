"""Tensors made views of one stack (`stack_as_views_`), and with it Linears over one input run as one
projection (`StackedProjection`): their weights become row slices of one stacked tensor, so a step
launches one GEMV (or GEMM) where it launched one per Linear (attention's q, k and v; a SwiGLU MLP's
gate and up). The MoE layers stack their experts' weights with the same primitive, for the grouped
GEMM (`layers.mlp.MoE.stacked_experts`, `layers.qwen_moe.SparseMoeBlock`).

Each Linear keeps its own parameter under its checkpoint name, a view of the stack: the state dict,
tensor-parallel slicing and in-place loads see the Linears as before. The stack is made once, when
the model's weights are final (`prepare_weights_` after a load), never during a forward: a CUDA graph
captured on the separate weights would read freed memory if a later forward restacked them. Where
the parameters stopped being views of the stack (moved, cast, replaced), the forward runs the
Linears one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from replayserve.layers.linear import Linear
from replayserve.ops.gemv import linear


def stack_as_views_(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenates `tensors` (parameters or buffers of one dtype and device, equal but for `dim`)
    along `dim` into one new tensor, and makes each of them a view of its slice (`.data` rebound:
    a module keeps its parameter under its name, and an in-place load lands in the stack). Each old
    storage is freed once nothing else holds it: the tensors' memory twice at most, while copying.
    Returns the stack."""
    with torch.no_grad():
        stack = torch.cat([t.detach() for t in tensors], dim=dim)
        start = 0
        for t in tensors:
            size = t.shape[dim]
            t.data = stack.narrow(dim, start, size)
            start += size
    return stack


def stackable(linears: Sequence[nn.Module]) -> bool:
    """Whether `stack_as_views_` may stack these Linears' weights (and biases) by rows: all plain
    `Linear`s (FP8 ones keep per-tensor scales), materialized, of one dtype, device and input width,
    with biases on all or none."""
    weights = [m.weight for m in linears]
    return (all(type(m) is Linear for m in linears) and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1
            and not weights[0].is_meta and len({m.bias is None for m in linears}) == 1)


class StackedProjection:
    """Linears of one input and dtype stacked by `stack_`; calling it gives their outputs."""

    def __init__(self, *linears: nn.Module) -> None:
        self.linears = linears
        self.sizes = [m.weight.shape[0] for m in linears]
        self._stack: tuple[Tensor, Tensor | None] | None = None

    def stack_(self) -> bool:
        """Makes every Linear's weight (and bias) a view of one (sum of outputs, in) tensor; False,
        and nothing changed, where they cannot (``stackable``)."""
        if not stackable(self.linears):
            return False
        weight = stack_as_views_([m.weight for m in self.linears])
        bias = None if self.linears[0].bias is None else stack_as_views_([m.bias for m in self.linears])
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
