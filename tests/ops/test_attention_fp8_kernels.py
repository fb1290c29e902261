"""The Triton KV write, decode and prefill kernels with float8_e4m3fn caches.

The write kernel must store ``to_fp8_cache``'s codes byte for byte (ties, values that round up into
the next binade, subnormals, saturation, -0.0); the attention kernels over FP8 caches must equal the
float64 ``paged_attention_ref`` over the values those codes stand for (``k_q * k_scale``,
``v_q * v_scale``). Caches are made by quantizing random K/V with ``to_fp8_cache``, NaN outside the
contexts (``make_batch``), so a kernel that reads past a context shows up as NaN. The entry points
on the kernels' path (``force_triton``) must follow their reference path on the same FP8 caches.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import Tensor

from replayserve.ops.attention import to_fp8_cache, write_kv_and_attend, write_kv_and_attend_decode
from replayserve.ops.dispatch import force_triton
from replayserve.ops.fp8 import FP8_DTYPE
from replayserve.ops.paged_attention_triton import paged_decode_attention_triton, write_kv_cache_triton
from replayserve.ops.prefill_attention_triton import paged_prefill_attention_triton
from tests.ops.test_paged_attention_triton import check, kv_writes, make_batch
from tests.ops.test_prefill_attention_triton import reference as prefill_reference

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
cuda_only = pytest.mark.skipif(not CUDA, reason="needs CUDA")
SCALES = [(1.0, 1.0), (0.02, 0.005), (3.0, 0.25)]  # (k_scale, v_scale)


def codes(x: Tensor) -> Tensor:
    return x.cpu().view(torch.uint8)


def every_rounding_case() -> Tensor:
    """Each positive FP8 value's midpoint to the next (a tie), a hair either side of it, the values
    themselves, past 448, deep below the smallest subnormal; with both signs and -0.0. fp32."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(FP8_DTYPE).float()  # 0 .. 448, NaN left out
    mid = (values[:-1] + values[1:]) / 2
    ulp = mid * 2.0**-20 + 2.0**-30
    pos = torch.cat([values, mid, mid - ulp, mid + ulp, torch.tensor([449.0, 464.0, 1e6, 1e-30, 2.0**-10])])
    return torch.cat([pos, -pos, torch.tensor([-0.0])])


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_the_write_kernel_stores_to_fp8_cache_codes_for_every_rounding_case(k_scale: float, v_scale: float) -> None:
    """The write kernel rounds in fp32 before its cast, so the interpreter's narrowing (wrong for
    values FP8 does not hold, ops/fp8_gemv_triton.py) gets values it holds: exact on the CPU too."""
    x = every_rounding_case()
    dh = 16
    tokens = -(-x.numel() // dh)
    k = torch.zeros(tokens * dh)
    k[: x.numel()] = x * k_scale
    k = k.view(tokens, 1, dh)
    v = torch.zeros(tokens * dh)
    v[: x.numel()] = x.flip(0) * v_scale
    v = v.view(tokens, 1, dh)
    caches = [torch.zeros(tokens, 1, 1, dh, dtype=FP8_DTYPE, device=DEVICE) for _ in range(2)]
    slots = torch.randperm(tokens, generator=torch.Generator().manual_seed(0))
    write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), *caches, slots.to(DEVICE), k_scale, v_scale)
    for cache, x, scale in zip(caches, (k, v), (k_scale, v_scale), strict=True):
        assert torch.equal(codes(cache).view(tokens, 1, dh)[slots], codes(to_fp8_cache(x, scale)))


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
def test_the_write_kernel_quantizes_random_kv_into_fp8_caches_and_skips_padding(k_scale: float,
                                                                                 v_scale: float) -> None:
    gen = torch.Generator().manual_seed(11)
    num_blocks, block_size, hkv, dh = 5, 4, 3, 20
    k, v, slots = kv_writes(gen, 13, hkv, dh, num_blocks, block_size, torch.float32)
    k, v = k * 50 * k_scale, v * v_scale  # some K past the range: saturated
    caches = [to_fp8_cache(torch.randn(num_blocks, block_size, hkv, dh, generator=gen), 1.0) for _ in range(2)]
    expected = [c.clone().view(-1, hkv, dh) for c in caches]
    keep = slots >= 0
    expected[0][slots[keep]] = to_fp8_cache(k[keep], k_scale)
    expected[1][slots[keep]] = to_fp8_cache(v[keep], v_scale)
    caches = [c.to(DEVICE) for c in caches]
    write_kv_cache_triton(k.to(DEVICE), v.to(DEVICE), *caches, slots.to(DEVICE), k_scale, v_scale)
    for got, want in zip(caches, expected, strict=True):
        assert torch.equal(codes(got).view(-1, hkv, dh), codes(want))


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_cuda_the_write_kernel_stores_to_fp8_cache_codes_of_random_kv(dtype: torch.dtype) -> None:
    """The 8B shape's K/V (8 KV heads of 128), 4096 tokens of random values at three magnitudes."""
    gen = torch.Generator().manual_seed(1)
    tokens, hkv, dh, block_size = 4096, 8, 128, 16
    for k_scale, v_scale in ((1.0, 1.0), (0.0213, 0.0071), (2.5, 0.4)):
        k = (torch.randn(tokens, hkv, dh, generator=gen) * 40 * k_scale).to(dtype).cuda()
        v = (torch.randn(tokens, hkv, dh, generator=gen) * v_scale).to(dtype).cuda()
        k[7, 3, :5] = v[100, 0, -3:] = float("nan")  # stay NaN (the interpreter's cast has no FP8 NaN)
        slots = torch.randperm(tokens, generator=gen).cuda()
        caches = [torch.zeros(tokens // block_size, block_size, hkv, dh, dtype=FP8_DTYPE, device="cuda")
                  for _ in range(2)]
        write_kv_cache_triton(k, v, *caches, slots, k_scale, v_scale)
        for cache, x, scale in zip(caches, (k, v), (k_scale, v_scale), strict=True):
            got = cache.view(tokens, hkv, dh)[slots]
            assert torch.equal(got.float().isnan(), x.isnan()) and x.isnan().sum() in (3, 5)
            finite = ~x.isnan()
            assert torch.equal(codes(got[finite]), codes(to_fp8_cache(x[finite], scale)))


def fp8_batch(gen: torch.Generator, rows: list[tuple[int, int]], hq: int, hkv: int, dh: int, block_size: int,
              dtype: torch.dtype, k_scale: float, v_scale: float) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(a batch with FP8 caches of random K/V at the scales' magnitudes, the same batch with the float64
    values the codes stand for), both on DEVICE."""
    batch = make_batch(gen, rows, hq, hkv, dh, block_size, dtype)
    batch["k_cache"] = to_fp8_cache(batch["k_cache"].float() * 2 * k_scale, k_scale)
    batch["v_cache"] = to_fp8_cache(batch["v_cache"].float() * v_scale, v_scale)
    wide = dict(batch, k_cache=batch["k_cache"].double() * k_scale, v_cache=batch["v_cache"].double() * v_scale)
    return tuple({k: t.to(DEVICE) for k, t in b.items()} for b in (batch, wide))  # type: ignore[return-value]


# (name, rows as (seq_len, query tokens), Hq, Hkv, Dh, block_size, width, num_splits): partial last
# blocks, contexts across the 64-position K/V tile, a padding row (seq_len 0), GQA groups 1, 3, 4.
DECODE = [
    ("gqa4-mixed-block4", [(37, 4), (1, 1), (0, 4), (16, 1), (100, 4), (5, 4)], 4, 1, 24, 4, 4, None),
    ("gqa1-decode-block16", [(70, 1), (0, 1), (16, 1), (3, 1)], 2, 2, 16, 16, 1, 1),
    ("gqa3-verify-block1", [(50, 3), (0, 3), (129, 3)], 6, 2, 32, 1, 3, 3),
]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize(("rows", "hq", "hkv", "dh", "block_size", "width", "splits"),
                         [pytest.param(*case[1:], id=case[0]) for case in DECODE])
def test_the_decode_kernel_over_fp8_caches_is_the_dequantized_reference(
        rows: list[tuple[int, int]], hq: int, hkv: int, dh: int, block_size: int, width: int, splits: int | None,
        k_scale: float, v_scale: float) -> None:
    gen = torch.Generator().manual_seed(len(rows) * 31 + hq)
    batch, wide = fp8_batch(gen, rows, hq, hkv, dh, block_size, torch.float32, k_scale, v_scale)
    scale = dh**-0.5
    out = paged_decode_attention_triton(**batch, scale=scale, max_query_len=width, num_splits=splits,
                                        k_scale=k_scale, v_scale=v_scale)
    check(wide, out, scale, torch.float32)


# A seq_len above the query count is a cached prefix: a later chunk of a chunked prefill or a
# prefix-cache hit; rows of a few queries are decode and verify rows mixed into the step.
PREFILL = [
    ("chunked-gqa2-block4", [(120, 30), (64, 1), (40, 39), (17, 16)], 4, 2, 32, 4, None),
    ("mixed-gqa4-block16", [(37, 1), (70, 4), (9, 6), (45, 45), (100, 2), (33, 20)], 8, 2, 16, 16, None),
    ("gqa3-block1-wide-tiles", [(90, 87), (60, 5), (8, 1)], 6, 2, 16, 1, {"BLOCK_M": 32, "BLOCK_N": 32}),
]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES)
@pytest.mark.parametrize(("rows", "hq", "hkv", "dh", "block_size", "tiles"),
                         [pytest.param(*case[1:], id=case[0]) for case in PREFILL])
def test_the_prefill_kernel_over_fp8_caches_is_the_dequantized_reference(
        rows: list[tuple[int, int]], hq: int, hkv: int, dh: int, block_size: int, tiles: dict[str, int] | None,
        k_scale: float, v_scale: float) -> None:
    gen = torch.Generator().manual_seed(len(rows) * 31 + hq + dh)
    batch, wide = fp8_batch(gen, rows, hq, hkv, dh, block_size, torch.float32, k_scale, v_scale)
    scale = dh**-0.5
    out = paged_prefill_attention_triton(**batch, scale=scale, tiles=tiles, k_scale=k_scale, v_scale=v_scale)
    torch.testing.assert_close(out.double(), prefill_reference(wide, scale), rtol=1e-4, atol=1e-5)


@cuda_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_cuda_the_kernels_over_fp8_caches_at_the_8b_shape(dtype: torch.dtype) -> None:
    """Decode rows of contexts up to 4096 and a 16 x 1024 prefill, 16-bit q over FP8 caches."""
    gen = torch.Generator().manual_seed(9)
    lens = torch.randint(1, 4097, (24,), generator=gen).tolist()
    batch, wide = fp8_batch(gen, [(n, 1) for n in lens], 32, 8, 128, 16, dtype, 0.0213, 0.0071)
    out = paged_decode_attention_triton(**batch, scale=128**-0.5, max_query_len=1, k_scale=0.0213, v_scale=0.0071)
    check(wide, out, 128**-0.5, dtype)
    batch, wide = fp8_batch(gen, [(1024, 1024)] * 16, 32, 8, 128, 16, dtype, 0.0213, 0.0071)
    out = paged_prefill_attention_triton(**batch, scale=128**-0.5, k_scale=0.0213, v_scale=0.0071)
    torch.testing.assert_close(out.double(), prefill_reference(wide, 128**-0.5), rtol=2e-2, atol=2e-2)


def entry_step(seed: int, lens: list[int], q_lens: list[int], hq: int, hkv: int, dh: int,
               block_size: int) -> dict[str, Tensor]:
    """A step's tensors for the entry points: sequence s's blocks after a shuffle, its last q_lens[s]
    positions this step's, the rest written earlier into FP8 caches (random codes)."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block_size) for n in lens)
    blocks = torch.randperm(len(lens) * width + 1, generator=gen)[: len(lens) * width].view(len(lens), width)
    slots = torch.cat([blocks[s, pos // block_size] * block_size + pos % block_size
                       for s, (n, q) in enumerate(zip(lens, q_lens, strict=True)) for pos in [torch.arange(n - q, n)]])
    t = sum(q_lens)
    cache = (len(lens) * width + 1, block_size, hkv, dh)
    k_cache, v_cache = (to_fp8_cache(torch.randn(cache, generator=gen), 1.0) for _ in range(2))
    return {"q": torch.randn(t, hq, dh, generator=gen), "k": 3 * torch.randn(t, hkv, dh, generator=gen),
            "v": torch.randn(t, hkv, dh, generator=gen), "k_cache": k_cache, "v_cache": v_cache, "slot_mapping": slots,
            "block_tables": blocks, "query_start_loc": torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]),
            "seq_lens": torch.tensor(lens)}


def run_entry(step: dict[str, Tensor], kernels: bool, k_scale: float, v_scale: float,
              width: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(output, K cache, V cache) of one entry point on copies of the step's caches: the decode op
    with `width`, else the general one; on the kernels' path (interpreter on the CPU) or the
    reference path."""
    s = {k: t.clone() for k, t in step.items()}
    args = (s["q"], s["k"], s["v"], s["k_cache"], s["v_cache"], s["slot_mapping"], s["block_tables"],
            s["query_start_loc"], s["seq_lens"], 0.3)
    with force_triton() if kernels else contextlib.nullcontext():
        if width is None:
            out = write_kv_and_attend(*args, k_scale, v_scale)
        else:
            out = write_kv_and_attend_decode(*args, width, k_scale, v_scale)
    return out, s["k_cache"], s["v_cache"]


@pytest.mark.parametrize(("k_scale", "v_scale"), SCALES[1:])
def test_on_the_kernels_path_the_entry_points_follow_the_reference_path_over_fp8_caches(k_scale: float,
                                                                                        v_scale: float) -> None:
    """A mixed step (chunked prefill, a fresh prompt, a decode row) and a uniform verify step of
    width 2: the same FP8 codes written, the same attention."""
    mixed = entry_step(3, [45, 20, 31], [15, 20, 1], 4, 2, 16, 8)
    verify = entry_step(4, [12, 40, 2], [2, 2, 2], 6, 2, 16, 4)
    for step, width in ((mixed, None), (verify, 2)):
        got, want = run_entry(step, True, k_scale, v_scale, width), run_entry(step, False, k_scale, v_scale, width)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        for a, b in zip(got[1:], want[1:], strict=True):
            assert torch.equal(codes(a), codes(b))


def test_a_16_bit_cache_ignores_the_checkpoints_kv_scales_on_both_paths() -> None:
    """An FP8 checkpoint served with kv_cache_dtype "auto": its scales reach the entry points and
    must not apply to a cache that holds K and V themselves."""
    step = entry_step(5, [30, 9], [30, 1], 4, 2, 16, 8)
    step["k_cache"], step["v_cache"] = step["k_cache"].float(), step["v_cache"].float()
    for width, s in ((None, step), (1, {**step, "q": step["q"][29:], "k": step["k"][29:], "v": step["v"][29:],
                                        "slot_mapping": step["slot_mapping"][29:],
                                        "query_start_loc": torch.tensor([0, 1, 2])})):
        plain = run_entry(s, False, 1.0, 1.0, width)[0]
        for kernels in (False, True):
            torch.testing.assert_close(run_entry(s, kernels, 0.02, 0.005, width)[0], plain, rtol=1e-4, atol=1e-5)
