"""Triton RMS norms against ``rms_norm_ref``, ``add_rms_norm_ref`` and ``gated_rms_norm_ref``.

Interpreter cases compare fp32 kernels with the float64 references; CUDA cases also run half
precision against the reference on the same inputs (same cast order, so within an ulp or two).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from replayserve.ops.norm import add_rms_norm_ref, gated_rms_norm_ref, rms_norm_ref
from replayserve.ops.norm_triton import add_rms_norm_triton, gated_rms_norm_triton, rms_norm_triton

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
EPS = 1e-5
# (rtol, atol) against the float64 reference, keyed by the output dtype.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (4e-3, 4e-3)}
SHAPES = [(3, 5, 40), (7, 64), (1, 200)]  # (..., D): non-power-of-two widths, a single row
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if CUDA else [])
if CUDA:
    SHAPES += [(64, 4096)]


def randn(gen: torch.Generator, *size: int, dtype: torch.dtype = torch.float32, strided: bool = False) -> Tensor:
    """Random values on the test device; `strided`: a view whose rows skip every other column block."""
    if strided:
        return torch.randn(*size[:-1], 2 * size[-1], generator=gen).to(DEVICE, dtype)[..., 1::2]
    return torch.randn(*size, generator=gen).to(DEVICE, dtype)


def close(actual: Tensor, expected: Tensor) -> None:
    rtol, atol = TOL[actual.dtype]
    torch.testing.assert_close(actual.double().cpu(), expected.double().cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    x, w = randn(gen, *shape, dtype=dtype, strided=len(shape) == 2), randn(gen, shape[-1], dtype=dtype)
    out = rms_norm_triton(x, w, EPS)
    assert out.dtype == dtype and out.shape == x.shape
    close(out, rms_norm_ref(x.double(), w.double(), EPS))
    if dtype != torch.float32:
        close(out, rms_norm_ref(x, w, EPS))


# (x dtype, residual dtype): the residual as wide as x, or kept in fp32 under half-precision x.
PAIRS = [(torch.float32, torch.float32)]
if CUDA:
    PAIRS += [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(("act", "res_dtype"), PAIRS)
def test_add_rms_norm_matches_reference(shape: tuple[int, ...], act: torch.dtype, res_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10 + sum(shape))
    x, w = randn(gen, *shape, dtype=act, strided=True), randn(gen, shape[-1], dtype=act)
    residual = randn(gen, *shape, dtype=res_dtype) * 4
    normed, summed = add_rms_norm_triton(x, residual, w, EPS)
    assert normed.dtype == act and summed.dtype == res_dtype
    ref_normed, ref_summed = add_rms_norm_ref(x, residual, w, EPS)
    # The sum is one fp32 add rounded to the residual's dtype: exact in both.
    torch.testing.assert_close(summed, ref_summed, rtol=0, atol=0)
    close(normed, ref_normed)
    close(normed, rms_norm_ref(ref_summed.double(), w.double(), EPS))


def test_add_rms_norm_reference_is_the_unfused_sequence() -> None:
    gen = torch.Generator().manual_seed(4)
    x, residual, w = (torch.randn(6, 32, generator=gen).bfloat16() for _ in range(3))
    normed, summed = add_rms_norm_ref(x, residual, w, EPS)
    assert torch.equal(summed, residual + x)
    assert torch.equal(normed, rms_norm_ref(residual + x, w, EPS))
    wide = residual.float()
    normed, summed = add_rms_norm_ref(x, wide, w, EPS)
    assert summed.dtype == torch.float32 and torch.equal(summed, wide + x.float())
    assert normed.dtype == torch.bfloat16 and torch.equal(normed, rms_norm_ref(wide + x.float(), w, EPS).bfloat16())


# (rows, D, group_size): groups of a power of two and not, one group per row.
GATED = [((5, 48), 16), ((3, 2, 72), 24), ((4, 40), 40)]
if CUDA:
    GATED += [((64, 8192), 1024)]


@pytest.mark.parametrize(("shape", "group_size"), GATED)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("before", [False, True])  # Falcon-H1's norm before the gate
def test_gated_rms_norm_matches_reference(shape: tuple[int, ...], group_size: int, dtype: torch.dtype,
                                          before: bool) -> None:
    gen = torch.Generator().manual_seed(group_size)
    x = randn(gen, *shape, dtype=dtype)
    z = randn(gen, *shape, dtype=dtype, strided=True)  # a slice of the input projection in the mixer
    w = randn(gen, shape[-1], dtype=dtype)
    out = gated_rms_norm_triton(x, z, w, EPS, group_size, before)
    assert out.dtype == dtype and out.shape == x.shape
    want = gated_rms_norm_ref(x.double(), z.double(), w.double(), EPS, group_size, before)
    close(out, want)
    # The two orders differ: a kernel that ignored the flag fails one of the two.
    assert not torch.allclose(want, gated_rms_norm_ref(x.double(), z.double(), w.double(), EPS, group_size,
                                                       not before), atol=1e-3)
    if dtype != torch.float32:
        close(out, gated_rms_norm_ref(x, z, w, EPS, group_size, before))


@cuda_only
def test_gated_rms_norm_mixed_weight_dtype() -> None:
    """fp32 weight with bf16 x: the bf16-rounded normalised value times the fp32 weight, in fp32."""
    gen = torch.Generator().manual_seed(9)
    x, z, w = randn(gen, 8, 256, dtype=torch.bfloat16), randn(gen, 8, 256, dtype=torch.bfloat16), randn(gen, 256)
    out = gated_rms_norm_triton(x, z, w, EPS, 64)
    ref = gated_rms_norm_ref(x, z, w, EPS, 64)
    assert out.dtype == ref.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@cuda_only
def test_norms_replay_in_a_graph() -> None:
    gen = torch.Generator().manual_seed(2)
    x, z, res = (randn(gen, 16, 512, dtype=torch.bfloat16) for _ in range(3))
    w = randn(gen, 512, dtype=torch.bfloat16)

    def step() -> tuple[Tensor, ...]:
        return (rms_norm_triton(x, w, EPS), *add_rms_norm_triton(x, res, w, EPS),
                gated_rms_norm_triton(x, z, w, EPS, 128))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for _ in range(2):
        for t in (x, z, res):
            t.copy_(randn(gen, 16, 512, dtype=torch.bfloat16))
        graph.replay()
        refs = (rms_norm_ref(x, w, EPS), *add_rms_norm_ref(x, res, w, EPS), gated_rms_norm_ref(x, z, w, EPS, 128))
        for got, want in zip(outs, refs, strict=True):
            close(got, want)
