"""quantize_fp8_triton (one launch) against the references quantize_fp8 (static scale) and
quantize_fp8_rows (a scale per row). On the CPU the interpreter narrows fp32 to FP8 wrongly (see
ops/fp8_gemv_triton.py), so rows are built from values FP8 holds exactly after division by their
scale; random rows, and their rounding, are checked on a GPU."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.fp8 import FP8_DTYPE, FP8_MAX, quantize_fp8, quantize_fp8_rows
from replayserve.ops.fp8_quant_triton import quantize_fp8_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def exact_rows(m: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(M, K) fp32 rows whose m-th row is FP8 codes times a power-of-two scale 2^-m, with +-448 in
    each nonzero row so that its amax / 448 is that scale; the last row is all zeros."""
    gen = torch.Generator().manual_seed(seed)
    codes = (torch.randn(m, k, generator=gen) * 40).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    codes[:, torch.randint(k, (m,), generator=gen)[0]] = 0.0
    codes[torch.arange(m), torch.randint(k, (m,), generator=gen)] = FP8_MAX * torch.sign(torch.randn(m, generator=gen))
    codes[-1] = 0.0
    scales = 2.0 ** -torch.arange(m, dtype=torch.float32)[:, None]
    return codes * scales, codes


@pytest.mark.parametrize("k", [40, 2048, 5000])  # one step, exactly one block, several steps with a tail
def test_dynamic_rows_get_their_own_scale_and_codes(k: int) -> None:
    x, codes = exact_rows(5, k, seed=k)
    q, scale = quantize_fp8_triton(x.to(DEVICE))
    want_q, want_scale = quantize_fp8_rows(x)
    assert q.dtype == FP8_DTYPE and scale.shape == (5, 1) and scale.dtype == torch.float32
    torch.testing.assert_close(scale.cpu(), want_scale, rtol=0, atol=0)
    assert want_scale[-1].item() == 1.0  # an all-zero row: 1.0, not a zero scale
    torch.testing.assert_close(q.cpu().float(), want_q.float(), rtol=0, atol=0)
    torch.testing.assert_close(q.cpu().float(), codes, rtol=0, atol=0)


def test_a_static_scale_saturates_and_any_strides_are_read() -> None:
    x, codes = exact_rows(4, 96, seed=3)
    x = x[:, None, :].expand(4, 2, 96)[:, 1, :]  # rows 2 * 96 apart
    scale = torch.tensor(0.25)
    q, got_scale = quantize_fp8_triton(x.to(DEVICE), scale.to(DEVICE))
    assert got_scale.shape == () and got_scale.item() == 0.25
    want = quantize_fp8(x, scale)
    assert (want.float().abs() == FP8_MAX).sum() >= 2  # the +-448 of rows 0 and 1 saturate
    torch.testing.assert_close(q.cpu().float(), want.float(), rtol=0, atol=0)


@pytest.mark.skipif(not CUDA, reason="FP8 rounding of random values: the interpreter rounds wrongly")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_random_rows_round_like_the_reference(dtype: torch.dtype) -> None:
    x = (torch.randn(300, 4096, device="cuda") * torch.rand(300, 1, device="cuda") * 10).to(dtype)
    q, scale = quantize_fp8_triton(x)
    want_q, want_scale = quantize_fp8_rows(x)
    torch.testing.assert_close(scale, want_scale, rtol=0, atol=0)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    static = torch.tensor(0.01, device="cuda")
    q, _ = quantize_fp8_triton(x, static)
    assert torch.equal(q.view(torch.uint8), quantize_fp8(x, static).view(torch.uint8))


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match=r"x must be \(M, K\)"):
        quantize_fp8_triton(torch.zeros(2, 3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="input_scale must hold one value"):
        quantize_fp8_triton(torch.zeros(2, 4, device=DEVICE), torch.ones(2, device=DEVICE))
