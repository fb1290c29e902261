"""Grammar masks on logits: xgrammar's kernel (float32 / bfloat16 / float16) against the
plain-PyTorch reference, on a subset of rows and a vocabulary that is not a multiple of 32."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.token_bitmask import apply_token_bitmask, apply_token_bitmask_ref, unpack_bitmask

VOCAB = 1000  # not a multiple of 32: the last word is partly padding
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # xgrammar's C++ kernel, its Triton kernel


def _bitmask(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A random packed bitmask and the (rows, VOCAB) bool mask it packs."""
    allowed = torch.rand(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) < 0.3
    padded = torch.zeros(rows, (VOCAB + 31) // 32 * 32, dtype=torch.int64)
    padded[:, :VOCAB] = allowed.long()
    words = (padded.reshape(rows, -1, 32) << torch.arange(32)).sum(-1)  # bit j of word w: token 32 w + j
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32), allowed


def test_unpack_reads_the_bits_back() -> None:
    bitmask, allowed = _bitmask(3, 0)
    assert torch.equal(unpack_bitmask(bitmask, VOCAB), allowed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [4, 1], [2]])
@pytest.mark.parametrize("device", DEVICES)
def test_the_kernel_masks_the_rows_as_the_reference(dtype: torch.dtype, rows: list[int], device: str) -> None:
    pytest.importorskip("xgrammar")
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    bitmask, allowed = _bitmask(len(rows), 2)
    bitmask, allowed, index = bitmask.to(device), allowed.to(device), torch.tensor(rows, device=device)
    expected = logits.clone()
    apply_token_bitmask_ref(expected, bitmask, index)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, index)
    if rows == [0, 1, 2, 3, 4]:  # every row: the caller may say so with None
        every = logits.clone()
        apply_token_bitmask(every, bitmask)
        assert torch.equal(every, expected)
    assert torch.equal(got, expected)
    for i, row in enumerate(rows):
        assert torch.equal(got[row][allowed[i]], logits[row][allowed[i]])
        assert bool((got[row][~allowed[i]] == -torch.inf).all())
    untouched = [r for r in range(5) if r not in rows]
    assert torch.equal(got[untouched], logits[untouched])
