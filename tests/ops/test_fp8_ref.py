"""The FP8 references (ops/fp8.py) against first principles: the table of every finite e4m3 value,
float64 matmuls of the values the FP8 tensors stand for, and the requantization of fused shards."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_fp8,
    fp8_linear_ref,
    fp8_scale,
    quantize_fp8,
    quantize_fp8_per_tensor,
    requantize_to_max_scale,
)

F64 = torch.float64


def e4m3_values() -> torch.Tensor:
    """Every finite float8_e4m3fn value, sorted, from the bit patterns (0x7f and 0xff are NaN)."""
    bits = torch.arange(256, dtype=torch.int16).to(torch.uint8)
    values = bits.view(FP8_DTYPE).to(F64)
    return values[~values.isnan()].unique()


def nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to the nearest e4m3 value by brute force, ties to the even bit pattern, saturating."""
    table = e4m3_values()
    clamped = x.clamp(-FP8_MAX, FP8_MAX)
    dist = (clamped[:, None] - table[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    candidates = dist == best
    out = torch.empty_like(x)
    for i in range(x.numel()):
        options = table[candidates[i]]
        if len(options) == 1:
            out[i] = options[0]
        else:  # a tie: the even mantissa (bit pattern) wins
            patterns = options.to(FP8_DTYPE).view(torch.uint8).to(torch.int16)
            out[i] = options[(patterns % 2 == 0).nonzero()[0, 0]]
    return out


def test_the_table_spans_448_and_has_253_finite_values() -> None:
    table = e4m3_values()
    assert table.max() == FP8_MAX == 448.0 and table.min() == -448.0
    assert len(table) == 253  # 254 finite patterns, +0 and -0 equal


def test_quantize_rounds_to_the_nearest_value_ties_to_even_and_saturates() -> None:
    gen = torch.Generator().manual_seed(0)
    table = e4m3_values()
    midpoints = (table[1:] + table[:-1]) / 2  # every tie
    x = torch.cat([torch.randn(2000, generator=gen, dtype=F64) * 60, midpoints, table,
                   torch.tensor([448.1, 464.0, 500.0, 1e6, -1e6, -470.0], dtype=F64)])
    got = quantize_fp8(x, torch.tensor(1.0)).to(F64)
    assert torch.equal(got, nearest_e4m3(x))
    assert torch.isnan(quantize_fp8(torch.tensor([float("nan")]), torch.tensor(1.0)).float()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
def test_per_tensor_scale_puts_the_largest_magnitude_on_448(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(37, 53, generator=gen, dtype=F64) * 0.03).to(dtype)
    q, scale = quantize_fp8_per_tensor(x)
    assert q.dtype == FP8_DTYPE and scale.dtype == torch.float32 and scale.dim() == 0
    assert scale == x.abs().max().float() / 448
    assert q.float().abs().max() == 448.0
    # Every value is within half a step of e4m3 (relative 2^-4) of x, or below the subnormal step.
    back = dequantize_fp8(q, scale, F64)
    err = (back - x.to(F64)).abs()
    assert (err <= x.to(F64).abs() * 2**-4 + scale.double() * 2**-10).all()


def test_an_all_zero_tensor_gets_scale_one() -> None:
    q, scale = quantize_fp8_per_tensor(torch.zeros(4, 4))
    assert scale == 1.0 and (q.float() == 0).all()


def test_dequantize_is_the_product_rounded_once() -> None:
    q = torch.tensor([1.0, -3.5, 448.0, 0.001953125]).to(FP8_DTYPE)
    scale = torch.tensor(0.0123)
    assert torch.equal(dequantize_fp8(q, scale, F64), q.to(F64) * scale.to(F64))
    assert torch.equal(dequantize_fp8(q, scale, torch.bfloat16), (q.float() * scale).bfloat16())


@pytest.mark.parametrize("static", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_ref_is_the_float64_product_of_the_values_stood_for(static: bool, bias: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 5, 96, generator=gen, dtype=F64)
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(40, 96, generator=gen) * 0.05)
    x_s = fp8_scale(x) * 0.7 if static else None  # a static scale that saturates the largest inputs
    b = torch.randn(40, generator=gen, dtype=F64) if bias else None
    got = fp8_linear_ref(x, w_q, w_s, x_s, b)
    w = w_q.to(F64) * w_s.double()
    if static:
        xq = nearest_e4m3((x / x_s.double()).flatten()).reshape(x.shape) * x_s.double()
        assert (xq.abs().max() - 448 * x_s.double()).abs() < 1e-12  # saturated, not NaN
    else:
        xq = x
    expected = torch.einsum("bsk,nk->bsn", xq, w) + (b if bias else 0)
    assert got.dtype == F64 and got.shape == (3, 5, 40)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_fp8_linear_ref_in_bf16_returns_bf16_computed_in_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 64, generator=gen).bfloat16()
    w_q, w_s = quantize_fp8_per_tensor(torch.randn(16, 64, generator=gen))
    got = fp8_linear_ref(x, w_q, w_s, None)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, (x.float() @ (w_q.float() * w_s).t()).bfloat16())
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear_ref(x, w_q.float(), w_s, None)


def test_requantize_keeps_the_largest_scale_shard_and_rounds_the_others() -> None:
    gen = torch.Generator().manual_seed(4)
    shards = [torch.randn(n, 32, generator=gen) * s for n, s in [(8, 0.02), (4, 0.5), (6, 0.1)]]
    quantized = [quantize_fp8_per_tensor(w) for w in shards]
    fused, scale = requantize_to_max_scale([q for q, _ in quantized], [s for _, s in quantized])
    assert fused.dtype == FP8_DTYPE and fused.shape == (18, 32) and scale == quantized[1][1]
    parts = fused.split([8, 4, 6])
    assert torch.equal(parts[1].view(torch.uint8), quantized[1][0].view(torch.uint8))  # bit for bit
    for (q, s), part in zip(quantized, parts, strict=True):
        exact = q.to(F64) * s.double() / scale.double()
        assert torch.equal(part.to(F64), nearest_e4m3(exact.flatten()).reshape(exact.shape))
    assert fused.float().abs().max() <= 448


def test_requantize_rejects_mismatched_inputs() -> None:
    q, s = quantize_fp8_per_tensor(torch.ones(2, 4))
    with pytest.raises(ValueError, match="one scale per shard"):
        requantize_to_max_scale([q, q], [s])
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        requantize_to_max_scale([q.float()], [s])
