"""fp8_gemv_triton (FP8-weight GEMV for decode rows) against fp8_linear_ref in float64.

On the CPU it runs in the Triton interpreter in fp32. The interpreter widens FP8 exactly but
narrows fp32 to FP8 wrongly (see ops/fp8_gemv_triton.py), so there the input-scale path gets
activations that FP8 holds exactly; the GPU test rounds random activations.
"""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.fp8 import FP8_DTYPE, fp8_linear_ref, fp8_scale, quantize_fp8, quantize_fp8_per_tensor
from replayserve.ops.fp8_gemv_triton import FP8_GEMV_MAX_ROWS, fp8_gemv_tiles, fp8_gemv_triton, packed_words
from replayserve.ops.gemv_triton import gemv_tiles

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
# fp32 in the interpreter (its bf16 is broken); bf16 and fp16 on a GPU, with tolerances of their rounding.
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}
F64 = torch.float64


def fp8_weight(gen: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_fp8_per_tensor(torch.randn(n, k, generator=gen, dtype=F64) / k**0.5)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "fp8-loads"])
@pytest.mark.parametrize(("rows", "n", "k", "bias"), [(1, 10, 700, True), (1, 37, 1500, False), (3, 9, 5000, True),
                                                      (8, 5, 16400, False), (5, 33, 300, True)])
def test_fp8_gemv_without_input_scale_matches_float64(dtype: torch.dtype, packed: bool, rows: int, n: int, k: int,
                                                      bias: bool) -> None:
    """Each of the three K tile ranges; 1, a non-power-of-two and the largest row count; N not a
    multiple of the row tile, K not of the column tile; a strided x. The weight: rows 4-byte aligned
    with a row stride beyond K (read as int32 words), or a column stride of 2 (FP8 loads)."""
    gen = torch.Generator().manual_seed(n * rows)
    wide = torch.randn(rows, 2 * k, generator=gen, dtype=F64)
    w_q, w_s = fp8_weight(gen, n, k)
    b = torch.randn(n, generator=gen, dtype=F64) if bias else None
    x = wide[:, ::2].to(DEVICE, dtype)  # column stride 2
    buffer = torch.empty(n, 2 * k, dtype=FP8_DTYPE, device=DEVICE)
    w_strided = buffer[:, 4:k + 4] if packed else buffer[:, ::2]
    w_strided.copy_(w_q)
    assert (packed_words(w_strided) is not None) == packed
    got = fp8_gemv_triton(x, w_strided, w_s.to(DEVICE), None, None if b is None else b.to(DEVICE, dtype),
                          packed=packed)
    assert got.shape == (rows, n) and got.dtype == dtype
    want = fp8_linear_ref(x.double().cpu(), w_q, w_s, None, None if b is None else b.to(dtype).double())
    assert rel_err(got, want) < TOL[dtype]


@pytest.mark.parametrize(("rows", "n", "k"), [(1, 24, 640), (4, 17, 4500)])
def test_fp8_gemv_with_input_scale_on_activations_fp8_holds(rows: int, n: int, k: int) -> None:
    """x = (FP8 values) * input_scale, some at +-448 * scale: the kernel's rounding is exact, so this
    checks the input-scale path's arithmetic (divide, clamp, widen, both scales at the end) wherever
    the kernel runs, the interpreter included."""
    gen = torch.Generator().manual_seed(k)
    w_q, w_s = fp8_weight(gen, n, k)
    x_scale = torch.tensor(0.0173)
    x_codes = quantize_fp8(torch.randn(rows, k, generator=gen) * 100, torch.tensor(1.0))
    x = x_codes.float() * x_scale
    assert torch.equal(quantize_fp8(x, x_scale).view(torch.uint8), x_codes.view(torch.uint8))  # FP8 holds x
    got = fp8_gemv_triton(x.to(DEVICE), w_q.to(DEVICE), w_s.to(DEVICE), x_scale.to(DEVICE))
    want = fp8_linear_ref(x.double(), w_q, w_s, x_scale)
    assert rel_err(got, want) < TOL[torch.float32]


@pytest.mark.skipif(not CUDA, reason="the Triton interpreter narrows fp32 to FP8 wrongly (carries across a power "
                                     "of two are lost, ties round up); rounding random activations needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2, 7])
def test_fp8_gemv_rounds_random_activations_like_the_reference(dtype: torch.dtype, rows: int) -> None:
    """A static input scale below the activations' amax / 448, so the largest inputs saturate."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 1000, 4096
    w_q, w_s = fp8_weight(gen, n, k)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    x_scale = fp8_scale(x) * 0.8
    got = fp8_gemv_triton(x.cuda(), w_q.cuda(), w_s.cuda(), x_scale.cuda())
    want = fp8_linear_ref(x.double(), w_q, w_s, x_scale)
    # The kernel and the reference may round an activation that sits on a rounding boundary apart
    # (fp32 division orders); one such step in a 4096-term sum stays far below this tolerance.
    assert rel_err(got, want) < TOL[dtype] + 1e-3


def test_fp8_gemv_tiles_cover_the_rows_and_keep_the_accumulator_size() -> None:
    assert fp8_gemv_tiles(1, 5000) == (1, 8, 1024, 4) and fp8_gemv_tiles(1, 2688) == (1, 8, 512, 2)  # the swept picks
    block_n, block_k, _ = gemv_tiles(5000)
    for rows in range(2, FP8_GEMV_MAX_ROWS + 1):
        block_m, bn, bk, _ = fp8_gemv_tiles(rows, 5000)
        assert block_m >= rows and bn == block_n and block_m * bk == block_k


def test_fp8_gemv_rejects_what_it_does_not_take() -> None:
    w = torch.zeros(4, 8, dtype=FP8_DTYPE, device=DEVICE)
    s = torch.ones((), device=DEVICE)
    with pytest.raises(ValueError, match="1 <= M"):
        fp8_gemv_triton(torch.zeros(FP8_GEMV_MAX_ROWS + 1, 8, device=DEVICE), w, s)
    with pytest.raises(ValueError, match="do not match"):
        fp8_gemv_triton(torch.zeros(1, 7, device=DEVICE), w, s)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemv_triton(torch.zeros(1, 8, device=DEVICE), w.float(), s)
    with pytest.raises(ValueError, match="one value each"):
        fp8_gemv_triton(torch.zeros(1, 8, device=DEVICE), w, torch.ones(2, device=DEVICE))


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "fp8-loads"])
def test_fp8_gemv_widens_every_fp8_value_exactly(packed: bool) -> None:
    """Every e4m3 code but the two NaNs (subnormals, both zeros, +-448) at each of the 4 byte positions
    of an int32 word: one-hot rows of x pick single weights, which must come back exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    k = 4
    index = (torch.arange(len(codes))[:, None] + 67 * torch.arange(k)[None, :]) % len(codes)
    weight = codes[index].view(FP8_DTYPE)  # (254, 4): every code once per column, other codes beside it
    x = torch.eye(k, dtype=torch.float32)
    got = fp8_gemv_triton(x.to(DEVICE), weight.to(DEVICE), torch.ones((), device=DEVICE), packed=packed)
    want = weight.float().T
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()


def test_fp8_gemv_packed_refuses_what_it_cannot_read_as_words() -> None:
    w = torch.zeros(4, 10, dtype=FP8_DTYPE, device=DEVICE)
    with pytest.raises(ValueError, match="packed=True needs"):
        fp8_gemv_triton(torch.zeros(1, 10, device=DEVICE), w, torch.ones((), device=DEVICE), packed=True)
