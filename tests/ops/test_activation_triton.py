"""The Triton relu^2 equals relu_square_ref bit for bit (fp32 in the interpreter, also bf16 and fp16
on CUDA), on sizes that end inside a block, in place."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.activation import relu_square_ref, silu_mul_ref
from replayserve.ops.activation_triton import relu_square_triton_, silu_mul_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 7), (3, 2049), (5, 4096)])
def test_relu_square_triton_equals_the_reference(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    gen = torch.Generator().manual_seed(shape[1])
    x = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    assert (x < 0).any() and (x > 0).any()
    want = relu_square_ref(x)
    got = relu_square_triton_(x)
    assert got.data_ptr() == x.data_ptr()  # in place
    assert torch.equal(got, want)


def test_relu_square_triton_refuses_a_strided_tensor() -> None:
    x = torch.randn(4, 8, device=DEVICE)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        relu_square_triton_(x)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rows", "n", "halves"), [(1, 7, False), (3, 2049, True), (5, 4096, True)])
def test_silu_mul_triton_equals_the_reference(dtype: torch.dtype, rows: int, n: int, halves: bool) -> None:
    """Halves: gate and up are the two strided halves of one (rows, 2n) projection output, as in Granite's MLP."""
    gen = torch.Generator().manual_seed(n)
    if halves:
        gate, up = (torch.randn(rows, 2 * n, generator=gen) * 3).to(dtype).to(DEVICE).chunk(2, dim=-1)
    else:
        gate, up = ((torch.randn(rows, n, generator=gen) * 3).to(dtype).to(DEVICE) for _ in range(2))
    want = silu_mul_ref(gate, up)
    got = silu_mul_triton(gate, up)
    assert got.is_contiguous() and got.dtype == dtype
    assert not torch.allclose(got, gate * up)  # the silu matters
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # an ulp of bf16 / fp16 where the two exps differ
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
