"""The Linear of a ModelOpt FP8 checkpoint: a float8_e4m3fn weight with its per-tensor
``weight_scale`` (and the static activation ``input_scale`` when the checkpoint has one), under
the checkpoint's names, computed by ``ops.fp8_linear.fp8_linear`` (which picks the kernel)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from replayserve.ops.fp8 import FP8_DTYPE
from replayserve.ops.fp8_gemm import row_wise_weight_scale
from replayserve.ops.fp8_linear import fp8_linear


class FP8Linear(nn.Module):
    """``y = x W^T + b`` with ``W = weight * weight_scale`` stored in FP8.

    Parameters and buffers, as the checkpoint names them: ``weight`` (out, in) float8_e4m3fn,
    ``weight_scale`` 0-dim float32, ``input_scale`` 0-dim float32 or None (activations then stay
    16-bit on the GEMV path and are scaled per call on the GEMM path), ``bias`` (out,) or None.
    ``model.to(dtype)`` casts the bias only: the codes and the scales keep their dtypes.

    ``weight_scale_rows``, not in the checkpoint: ``weight_scale`` as the (1, out) float32 scale of
    the GEMM path's row-wise scaling, made once by ``keep_row_scale_`` after the scale is final
    (loaded and folded: ``models/fp8_loading.keep_row_scales_``); None builds it per GEMM call.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, static_input_scale: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.register_buffer("weight_scale", torch.ones((), dtype=torch.float32))
        self.input_scale: Tensor | None
        self.register_buffer("input_scale", torch.ones((), dtype=torch.float32) if static_input_scale else None)
        self.bias: nn.Parameter | None
        self.register_parameter("bias", nn.Parameter(torch.empty(out_features)) if bias else None)
        self.weight_scale_rows: Tensor | None
        self.register_buffer("weight_scale_rows", None, persistent=False)

    @classmethod
    def replacing(cls, linear: nn.Linear, static_input_scale: bool) -> FP8Linear:
        """An FP8Linear of ``linear``'s shape, built on its device (the meta device while loading)."""
        with torch.device(linear.weight.device):
            return cls(linear.in_features, linear.out_features, linear.bias is not None, static_input_scale)

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> FP8Linear:
        # nn.Module.to(dtype) casts every floating-point tensor, float8 included; what the
        # conversion does to a float8 tensor tells a dtype cast (the bias follows it, the codes
        # and scales only change device) from a move or an allocation (all follow it).
        probe = fn(torch.empty(0, dtype=FP8_DTYPE, device=self.weight.device))
        if probe.dtype == FP8_DTYPE:
            return super()._apply(fn, recurse)
        bias, device = self.bias, probe.device
        return super()._apply(lambda t: fn(t) if bias is not None and t is bias else t.to(device), recurse)

    def keep_row_scale_(self) -> None:
        """Makes ``weight_scale_rows`` from ``weight_scale`` as it is now; a later change of
        ``weight_scale`` needs this again."""
        self.weight_scale_rows = row_wise_weight_scale(self.weight_scale, self.out_features)

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias, self.weight_scale_rows)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"static_input_scale={self.input_scale is not None}")
