"""Numerics convention shared by every reference op."""

from __future__ import annotations

import torch

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype an op should accumulate in for inputs of ``dtype``.

    Half-precision inputs (float16, bfloat16) compute in float32; every other
    dtype (float32, float64, ...) computes in itself, so float64 tests stay in
    float64 end to end.
    """
    if dtype in _LOW_PRECISION:
        return torch.float32
    return dtype

