"""fp8_scaled_mm (torch._scaled_mm) against fp8_linear_ref in float64: static input scales, and dynamic ones per
row (row-wise scaling; per tensor for a CUDA output other than bf16), bias in and after the epilogue, leading
batch dimensions; on the CPU (torch 2.13 runs _scaled_mm there too) and on a GPU when there is one."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.fp8 import (
    FP8_DTYPE,
    dequantize_fp8,
    fp8_linear_ref,
    fp8_scale,
    quantize_fp8_per_tensor,
    quantize_fp8_rows,
)
from replayserve.ops.fp8_gemm import fp8_scaled_mm, row_wise_weight_scale, scaled_mm_fits

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
F64 = torch.float64
# The output is rounded once to out_dtype: its relative step, plus the sums' rounding. On the CPU the
# sums are fp32; Hopper's FP8 tensor cores accumulate with fewer mantissa bits than fp32 (measured on
# an H100: 1e-4 to 5e-4 relative at K = 256), which a float32 output then shows.
TOL = {torch.bfloat16: 8e-3, torch.float16: 1e-3, torch.float32: 1e-3 if CUDA else 1e-5}


def dynamic_ref(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, b: torch.Tensor | None,
                out_dtype: torch.dtype) -> torch.Tensor:
    """What the GEMM path computes without an input scale, in float64: each row through FP8 with its
    own scale where the output allows row-wise scaling, else ``fp8_linear_ref`` with a per-tensor one."""
    if CUDA and out_dtype != torch.bfloat16:
        return fp8_linear_ref(x.double(), w_q, w_s, fp8_scale(x), None if b is None else b.double())
    q, s = quantize_fp8_rows(x.reshape(-1, x.shape[-1]))
    y = (q.double() * s.double()) @ dequantize_fp8(w_q, w_s, F64).t()
    return (y if b is None else y + b.double()).reshape(*x.shape[:-1], -1)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_scaled_mm_matches_the_reference(out_dtype: torch.dtype, static: bool, bias: bool) -> None:
    gen = torch.Generator().manual_seed(int(static) + 2 * int(bias))
    # M = 10 rows (not a multiple of 16) of magnitudes 0.01 to 10: a per-tensor scale would crush the small rows
    x = (torch.randn(2, 5, 256, generator=gen) * torch.logspace(-2, 1, 5)[:, None]).to(out_dtype)
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(96, 256, generator=gen) / 16)
    x_scale = fp8_scale(x) * 0.75 if static else None  # static: below amax / 448, so the largest inputs saturate
    b = torch.randn(96, generator=gen).to(out_dtype) if bias else None
    got = fp8_scaled_mm(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), None if x_scale is None else x_scale.to(DEVICE),
                        None if b is None else b.to(DEVICE))
    assert got.shape == (2, 5, 96) and got.dtype == out_dtype
    want = (dynamic_ref(x, w_q, w_s, b, out_dtype) if x_scale is None
            else fp8_linear_ref(x.double(), w_q, w_s, x_scale, None if b is None else b.double()))
    assert rel_err(got, want) < TOL[out_dtype]


def test_without_an_input_scale_the_scale_is_the_activations_own() -> None:
    """Dynamic quantization: scaling x scales the output exactly (the scale follows x's amax)."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(16, 64, generator=gen)
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(32, 64, generator=gen))
    w_q, w_s = w_q.to(DEVICE), w_s.to(DEVICE)
    y = fp8_scaled_mm(x.to(DEVICE), w_q, w_s, out_dtype=torch.float32)
    y8 = fp8_scaled_mm(8 * x.to(DEVICE), w_q, w_s, out_dtype=torch.float32)
    torch.testing.assert_close(y8, 8 * y, rtol=1e-6, atol=0)


def test_scaled_mm_fits_names_the_constraints() -> None:
    w = torch.zeros(32, 48, dtype=FP8_DTYPE)
    assert scaled_mm_fits(w)
    assert not scaled_mm_fits(torch.zeros(40, 48, dtype=FP8_DTYPE))  # N = 40
    assert not scaled_mm_fits(torch.zeros(32, 40, dtype=FP8_DTYPE))  # K = 40
    assert not scaled_mm_fits(w.t())  # column-major (N, K)
    assert not scaled_mm_fits(torch.zeros(32, 48))
    with pytest.raises(ValueError, match="multiples of 16.*fp8_linear_ref"):
        fp8_scaled_mm(torch.zeros(1, 40), torch.zeros(32, 40, dtype=FP8_DTYPE), torch.ones(()))
    with pytest.raises(ValueError, match="do not match"):
        fp8_scaled_mm(torch.zeros(1, 32), w, torch.ones(()))


def test_a_kept_row_scale_is_the_one_read_and_equals_the_built_one() -> None:
    """``weight_scale_rows`` is what the row-wise GEMM reads (twice the scale: twice the output),
    and ``row_wise_weight_scale`` gives what the call builds without one."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(6, 64, generator=gen).to(DEVICE)
    w_q, w_s = (t.to(DEVICE) for t in quantize_fp8_per_tensor(torch.randn(32, 64, generator=gen)))
    rows = row_wise_weight_scale(w_s, 32)
    assert rows.shape == (1, 32) and rows.dtype == torch.float32 and rows.is_contiguous()
    assert torch.equal(rows, w_s.expand(1, 32))
    out = torch.bfloat16  # row-wise on the CPU and on CUDA
    y = fp8_scaled_mm(x.to(out), w_q, w_s, weight_scale_rows=rows)
    torch.testing.assert_close(y, fp8_scaled_mm(x.to(out), w_q, w_s), rtol=0, atol=0)
    torch.testing.assert_close(fp8_scaled_mm(x.to(out), w_q, w_s, weight_scale_rows=2 * rows), 2 * y, rtol=0, atol=0)


@pytest.mark.parametrize("static", [True, False])
def test_a_16_bit_bias_goes_into_the_epilogue(static: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under row-wise scaling (no input scale; bf16 output on CUDA) a bf16 or fp16 bias goes to
    _scaled_mm's epilogue; per-tensor scaling and fp32 outputs add it after (cuBLASLt refuses a bias
    at some FP8 shapes and takes none for fp32)."""
    handed: list[torch.Tensor | None] = []
    scaled_mm = torch._scaled_mm

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        handed.append(kwargs.get("bias"))  # type: ignore[arg-type]
        return scaled_mm(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    w_q, w_s = (t.to(DEVICE) for t in quantize_fp8_per_tensor(torch.randn(32, 64)))
    for out_dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, b = torch.randn(4, 64, dtype=out_dtype, device=DEVICE), torch.randn(32, dtype=out_dtype, device=DEVICE)
        fp8_scaled_mm(x, w_q, w_s, fp8_scale(x) if static else None, b)
        row_wise = not static and (out_dtype == torch.bfloat16 or DEVICE == "cpu")
        assert (handed[-1] is not None) == (row_wise and out_dtype != torch.float32), out_dtype
        if handed[-1] is not None:
            assert handed[-1].dtype == out_dtype and torch.equal(handed[-1], b)
