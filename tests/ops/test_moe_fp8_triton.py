"""The fused MoE on FP8 experts (float8_e4m3fn stacks, one scale per expert) equals the reference
that dequantizes each expert and runs the 16/32-bit path, on fresh random inputs: fp32 activations
in the Triton interpreter on the CPU (it widens FP8 exactly), bf16 too on CUDA. The scales differ
by expert by orders of magnitude, so an expert read with another's scale cannot pass."""

from __future__ import annotations

import pytest
import torch

from replayserve.ops.fp8 import FP8_DTYPE, dequantize_fp8, quantize_fp8_per_tensor
from replayserve.ops.moe import fused_moe_ref
from replayserve.ops.moe_triton import GemmConfig, default_config, fused_moe_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
F64 = torch.float64


def fp8_stack(num: int, rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(num, rows, cols) float8_e4m3fn, each expert quantized on its own with magnitudes 10^-1..10^1
    apart, and the (num,) float32 scales."""
    codes, scales = [], []
    for e in range(num):
        w = torch.randn(rows, cols, generator=gen, dtype=F64) / cols**0.5 * 10.0 ** (e % 3 - 1)
        q, s = quantize_fp8_per_tensor(w)
        codes.append(q)
        scales.append(s)
    return torch.stack(codes), torch.stack(scales)


def dequantized(stack: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each expert's values in float64, expert e with scale[min(e, E_s - 1)], built without the op's helpers."""
    return torch.stack([dequantize_fp8(w, scale[min(e, len(scale) - 1)], F64) for e, w in enumerate(stack)])


def tiles(num_pairs: int, num_experts: int, swap_ab: bool = False) -> GemmConfig | None:
    """As test_moe_triton's ``_small_tiles``: the defaults on CUDA (64-wide tiles when swapped), 16-wide
    tiles in the interpreter."""
    if DEVICE == "cuda":
        block_m = default_config(num_pairs, num_experts).block_m
        return GemmConfig(block_m=block_m, block_n=64, block_k=64, swap_ab=True) if swap_ab else None
    return GemmConfig(block_m=default_config(num_pairs, num_experts).block_m, block_n=16, block_k=16, swap_ab=swap_ab)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("swap_ab", [False, True], ids=["plain", "swapped"])
@pytest.mark.parametrize(("num_tokens", "num_experts", "top_k", "width", "inner", "shared_pieces"), [
    (1, 8, 2, 32, 48, 0),     # a decode step
    (1, 10, 4, 32, 16, 2),    # the last 2 experts: one shared expert's pieces, one scale between them
    (7, 16, 3, 24, 40, 0),    # odd sizes, idle experts
    (40, 6, 2, 16, 32, 1),    # many tokens a block
])
def test_fp8_experts_equal_the_dequantized_reference(dtype: torch.dtype, swap_ab: bool, num_tokens: int,
                                                      num_experts: int, top_k: int, width: int, inner: int,
                                                      shared_pieces: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 13 + num_experts)
    w_up, s_up = fp8_stack(num_experts, inner, width, gen)
    w_down, s_down = fp8_stack(num_experts, width, inner, gen)
    if shared_pieces:  # one scale for the pieces: theirs is the first piece's, their codes any
        keep = num_experts - shared_pieces + 1
        s_up, s_down = s_up[:keep], s_down[:keep]
    x = torch.randn(num_tokens, width, generator=gen, dtype=F64)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    if shared_pieces:
        ids[:, -shared_pieces:] = torch.arange(num_experts - shared_pieces, num_experts)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.5

    x_dev = x.to(DEVICE, dtype)
    scales = (s_up.to(DEVICE), s_down.to(DEVICE))
    got = fused_moe_triton(x_dev, w_up.to(DEVICE), w_down.to(DEVICE), ids.to(DEVICE, torch.int32),
                           weights.to(DEVICE), config=tiles(num_tokens * top_k, num_experts, swap_ab), scales=scales)
    assert got.dtype == dtype and got.shape == (num_tokens, width)
    x64 = x_dev.cpu().double()
    want = fused_moe_ref(x64, dequantized(w_up, s_up), dequantized(w_down, s_down), ids, weights.double())
    torch.testing.assert_close(fused_moe_ref(x64, w_up, w_down, ids, weights.double(), scales=(s_up, s_down)), want)
    scale = want.abs().max().item()
    torch.testing.assert_close(got.cpu().double(), want, atol=TOL[dtype] * scale, rtol=TOL[dtype])


def test_an_expert_read_with_another_experts_scale_is_caught() -> None:
    gen = torch.Generator().manual_seed(5)
    w_up, s_up = fp8_stack(4, 16, 16, gen)
    w_down, s_down = fp8_stack(4, 16, 16, gen)
    x = torch.randn(3, 16, generator=gen)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]])
    weights = torch.ones(3, 2)
    want = fused_moe_ref(x.double(), w_up, w_down, ids, weights.double(), scales=(s_up, s_down))
    swapped = s_up[[1, 0, 2, 3]]
    got = fused_moe_triton(x.to(DEVICE), w_up.to(DEVICE), w_down.to(DEVICE), ids.to(DEVICE, torch.int32),
                           weights.to(DEVICE), config=tiles(6, 4), scales=(swapped.to(DEVICE), s_down.to(DEVICE)))
    assert not torch.allclose(got.cpu().double(), want, atol=1e-3 * want.abs().max().item())


def test_fp8_stacks_and_scales_must_come_together() -> None:
    w = torch.zeros(4, 8, 8, dtype=FP8_DTYPE)
    x, ids, weights = torch.zeros(1, 8), torch.zeros(1, 2, dtype=torch.int64), torch.ones(1, 2)
    with pytest.raises(ValueError, match="need their per-expert scales"):
        fused_moe_ref(x, w, w, ids, weights)
    with pytest.raises(ValueError, match="1 <= E_s <= 4"):
        fused_moe_ref(x, w, w, ids, weights, scales=(torch.ones(5), torch.ones(5)))
    with pytest.raises(ValueError, match="are for float8_e4m3fn"):
        fused_moe_ref(x, w.float(), w.float(), ids, weights, scales=(torch.ones(4), torch.ones(4)))
