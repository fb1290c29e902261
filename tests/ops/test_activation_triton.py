"""The Triton relu^2 equals relu_square_ref bit for bit (fp32 in the interpreter, also bf16 and fp16
on CUDA), on sizes that end inside a block, in place."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.activation import relu_square_ref
from replayserve.ops.activation_triton import relu_square_triton_

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
