"""copy_rows_triton against copy_rows_ref: whole slot rows moved between pools (and within one)."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.copy_rows import copy_rows, copy_rows_ref
from replayserve.ops.copy_rows_triton import copy_rows_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
DTYPES = [(torch.float32, torch.float32)] + ([(torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)]
                                             if CUDA else [])


@pytest.mark.parametrize(("src_dtype", "dst_dtype"), DTYPES)
@pytest.mark.parametrize("row_shape", [(3, 5, 7), (2, 64, 70)])  # one program per row; several per row
def test_copy_rows_between_pools_matches_ref(src_dtype: torch.dtype, dst_dtype: torch.dtype,
                                             row_shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(0)
    src = torch.randn(9, *row_shape, generator=gen).to(DEVICE, src_dtype)
    dst = torch.randn(6, *row_shape, generator=gen).to(DEVICE, dst_dtype)
    src_index = torch.tensor([7, 0, 7, 3], device=DEVICE)  # a source row may be read twice
    dst_index = torch.tensor([2, 5, 0, 4], device=DEVICE)
    expected, before = dst.clone(), src.clone()
    copy_rows_ref(src, src_index, expected, dst_index)
    copy_rows_triton(src, src_index, dst, dst_index)
    assert torch.equal(dst, expected)
    assert torch.equal(src, before)
    assert torch.equal(dst[[1, 3]], expected[[1, 3]])  # rows not named are untouched


def test_copy_rows_within_one_pool_and_empty() -> None:
    pool = torch.arange(8 * 6, dtype=torch.float32, device=DEVICE).view(8, 2, 3)
    expected = pool.clone()
    expected[[5, 6]] = pool[[1, 2]]
    copy_rows(pool, torch.tensor([1, 2], device=DEVICE), pool, torch.tensor([5, 6], device=DEVICE))
    assert torch.equal(pool, expected)
    copy_rows_triton(pool, torch.empty(0, dtype=torch.int64, device=DEVICE), pool,
                     torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(pool, expected)


def test_copy_rows_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="row shapes differ"):
        copy_rows_triton(torch.zeros(2, 3), torch.tensor([0]), torch.zeros(2, 4), torch.tensor([1]))
    with pytest.raises(ValueError, match="contiguous rows"):
        copy_rows_triton(torch.zeros(2, 3, 4).transpose(1, 2), torch.tensor([0]), torch.zeros(2, 4, 3),
                         torch.tensor([1]))
