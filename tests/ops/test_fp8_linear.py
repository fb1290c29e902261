"""fp8_linear (the FP8 Linear's entry point) picks the path the shapes call for and each path
computes fp8_linear_ref. On the CPU: the reference without force_triton; the Triton GEMV (in the
interpreter, fp32, no input scale: see ops/fp8_gemv_triton.py) for up to FP8_GEMV_DISPATCH_ROWS rows
under it; more rows stay on the reference (``_scaled_mm`` runs on CUDA only). On a GPU the GEMM
path is checked as well."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_GEMV_DISPATCH_ROWS, fp8_linear_ref, fp8_scale, quantize_fp8_per_tensor
from replayserve.ops.fp8_linear import fp8_linear

CUDA = torch.cuda.is_available()


def operands(rows: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight, weight_scale = quantize_fp8_per_tensor(torch.randn(n, k, generator=gen) / k**0.5)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    return tuple(t.to(device) for t in (x, weight, weight_scale, bias))


@pytest.mark.parametrize("static", [False, True])
def test_the_cpu_path_is_the_reference(static: bool) -> None:
    x, weight, weight_scale, bias = operands(5, 24, 40, torch.float64)
    input_scale = fp8_scale(x) if static else None
    got = fp8_linear(x.view(1, 5, 40), weight, weight_scale, input_scale, bias)
    assert got.shape == (1, 5, 24)
    torch.testing.assert_close(got[0], fp8_linear_ref(x, weight, weight_scale, input_scale, bias), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, FP8_GEMV_DISPATCH_ROWS + 1, 9])
def test_under_the_kernels_decode_rows_take_the_gemv_and_larger_batches_a_path_that_serves(rows: int) -> None:
    # The kernels' device: the GPU where there is one (the interpreter runs CPU tensors only without it).
    x, weight, weight_scale, bias = operands(rows, 20, 48, torch.float32, "cuda" if CUDA else "cpu")
    want = fp8_linear_ref(x.double().cpu(), weight.cpu(), weight_scale.cpu(), None, bias.double().cpu())
    with force_triton():
        got = fp8_linear(x, weight, weight_scale, None, bias)
    # fp32 sums on both paths; on a GPU, rows past the GEMV take _scaled_mm, whose FP8 tensor cores
    # accumulate with fewer bits (tests/ops/test_fp8_gemm.py).
    tol = 1e-3 if CUDA and rows > FP8_GEMV_DISPATCH_ROWS else 1e-5
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)


@pytest.mark.skipif(not CUDA, reason="torch._scaled_mm runs on CUDA")
@pytest.mark.parametrize("rows", [1, 4, 64, 300])
def test_on_cuda_every_path_matches_the_reference(rows: int) -> None:
    x, weight, weight_scale, bias = operands(rows, 64, 256, torch.bfloat16, "cuda")
    input_scale = fp8_scale(x)
    want = fp8_linear_ref(x.double(), weight, weight_scale, input_scale, bias.double())
    got = fp8_linear(x, weight, weight_scale, input_scale, bias)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-2
