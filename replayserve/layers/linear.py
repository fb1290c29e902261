"""The projections' linear layer: ``nn.Linear`` (same parameters and checkpoint names) whose
one-row forward on CUDA in half precision is the Triton GEMV (``ops/gemv_triton.py``), faster than
cuBLAS's split-K kernels there. Every other input, and anything that needs autograd, is
``nn.Linear``'s own forward; float32 and float64 models never take the kernel."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class Linear(nn.Linear):
    def takes_gemv(self, x: Tensor) -> bool:
        """Whether ``forward(x)`` runs the Triton GEMV: one half-precision CUDA row, no autograd."""
        return (x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
                and self.weight.dtype == x.dtype and not (torch.is_grad_enabled() and self.weight.requires_grad))

    def forward(self, x: Tensor) -> Tensor:
        if self.takes_gemv(x):
            from replayserve.ops.gemv_triton import gemv_triton  # Triton only where the kernel runs

            return gemv_triton(x, self.weight, self.bias)
        return super().forward(x)
