"""The Triton RoPE equals ``apply_rope_ref`` on q and k (fp32 in the interpreter, bf16 too on CUDA):
full and partial rotary, GQA, positions far past the first period, strided rows (q a view of a wider
projection), in place; and the entry point's reference path on the step's tables equals it too."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.dispatch import force_triton
from replayserve.ops.rope import apply_rope_qk, apply_rope_ref, rope_cos_sin_ref, rope_inv_freq
from replayserve.ops.rope_triton import apply_rope_qk_triton_

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _qk(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, strided: bool,
        gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q (T, H, D) and k (T, Hkv, D); strided: q's rows are views of a (T, (H + 1) * D) buffer."""
    width = (heads + (1 if strided else 0)) * head_dim
    q = torch.randn(tokens, width, generator=gen).to(dtype).to(DEVICE)[:, : heads * head_dim]
    k = torch.randn(tokens, kv_heads * head_dim, generator=gen).to(dtype).to(DEVICE)
    return q.view(tokens, heads, head_dim) if not strided else q.unflatten(1, (heads, head_dim)), \
        k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "head_dim", "partial", "strided"), [
    (1, 4, 2, 32, 1.0, False),
    (5, 4, 4, 64, 0.5, True),
    (3, 6, 2, 24, 1.0, True),  # half 12: a masked tail
])
def test_rope_triton_equals_the_reference(dtype: torch.dtype, tokens: int, heads: int, kv_heads: int, head_dim: int,
                                          partial: float, strided: bool) -> None:
    gen = torch.Generator().manual_seed(tokens + head_dim)
    q, k = _qk(tokens, heads, kv_heads, head_dim, dtype, strided, gen)
    positions = torch.tensor([5, 7, 1000, 65535, 262143][:tokens] + [3] * max(0, tokens - 5), device=DEVICE)
    inv_freq = rope_inv_freq(int(head_dim * partial), 10000.0, device=DEVICE)
    want_q, want_k = apply_rope_ref(q, positions, inv_freq), apply_rope_ref(k, positions, inv_freq)
    assert not torch.allclose(want_q, q)  # a rotation that moves something
    got_q, got_k = apply_rope_qk_triton_(q, k, positions, inv_freq)
    assert got_q.data_ptr() == q.data_ptr() and got_k.data_ptr() == k.data_ptr()  # in place
    torch.testing.assert_close(got_q, want_q, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_k, want_k, atol=TOL[dtype], rtol=TOL[dtype])


def test_entry_point_takes_the_kernel_or_the_shared_tables() -> None:
    """The kernel rotates from inv_freq and never asks for the step's tables; the reference (float64:
    no kernel takes it) rotates by the tables it is handed, asked for once."""
    gen = torch.Generator().manual_seed(0)
    q, k = _qk(3, 4, 2, 32, torch.float32, False, gen)
    positions = torch.tensor([2, 9, 4000], device=DEVICE)
    inv_freq = rope_inv_freq(32, 10000.0, device=DEVICE)
    want = apply_rope_ref(q, positions, inv_freq), apply_rope_ref(k, positions, inv_freq)
    asked = []

    def tables_of(dtype: torch.dtype):  # noqa: ANN202
        asked.append(dtype)
        return rope_cos_sin_ref(positions, inv_freq, dtype)

    by_ref = apply_rope_qk(q.double(), k.double(), positions, inv_freq, lambda: tables_of(torch.float64))
    assert asked == [torch.float64]
    with force_triton():
        by_kernel = apply_rope_qk(q.clone(), k.clone(), positions, inv_freq, lambda: tables_of(torch.float32))
    assert asked == [torch.float64]  # the kernel made its own angles
    for got in (by_ref, by_kernel):
        torch.testing.assert_close(got[0].float(), want[0], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(got[1].float(), want[1], atol=2e-5, rtol=2e-5)
