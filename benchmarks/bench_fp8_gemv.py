"""Decode-sized linears with FP8 weights: the FP8 GEMV (``ops/fp8_gemv_triton``) and
``torch._scaled_mm`` (``ops/fp8_gemm``) against the bf16 paths (cuBLAS ``F.linear``, and the bf16
GEMV at one row), in CUDA graphs, weights cycled beyond L2 as ``bench_gemv.py`` does.

Each row prints microseconds and the weight-read rate against the copy bandwidth (FP8 reads half
the bytes, so its roofline time is half bf16's), the FP8 GEMV both ways it widens the weights
(FP8 loads and conversion instructions, the default; int32 words and integer ops, ``packed=True``).
``--sweep`` times the default path's tiles per shape at one row and prints the best beside
``fp8_gemv_tiles``' pick.

    python benchmarks/bench_fp8_gemv.py            # CUDA only, ~1 min
    python benchmarks/bench_fp8_gemv.py --sweep
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gemv import SHAPES, cycled_us, weight_copies  # noqa: E402
from roofline import measure_rates  # noqa: E402

from replayserve.ops.fp8 import quantize_fp8_per_tensor  # noqa: E402
from replayserve.ops.fp8_gemm import fp8_scaled_mm  # noqa: E402
from replayserve.ops.fp8_gemv_triton import _fp8_gemv_kernel, fp8_gemv_tiles, fp8_gemv_triton  # noqa: E402
from replayserve.ops.gemv_triton import gemv_triton  # noqa: E402

ROWS = (1, 4, 8)
# Candidate tiles: rows per program, K step, warps, pipeline stages (an FP8 tile is half a bf16 tile's bytes).
SWEEP = [(bn, bk, w, st) for bn, bk, w, st in itertools.product([1, 2, 4, 8, 16], [256, 512, 1024, 2048, 4096],
                                                                 [2, 4, 8], [1, 3]) if 32 * w <= bn * bk <= 32768]


def fp8_copies(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, scale) FP8 copies of an (n, k) weight totalling at least twice the L2 cache."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    count = max(1, -(-2 * l2 // (n * k)))
    return [quantize_fp8_per_tensor(torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5)
            for _ in range(count)]


def sweep_shape(copies: list[tuple[torch.Tensor, torch.Tensor]], x: torch.Tensor,
                x_scale: torch.Tensor) -> list[tuple[float, tuple[int, int, int, int]]]:
    n, k = copies[0][0].shape
    y = torch.empty(1, n, device="cuda", dtype=x.dtype)
    rows = []
    for tiles in SWEEP:
        bn, bk, warps, stages = tiles

        def call(ws: tuple[torch.Tensor, torch.Tensor], bn: int = bn, bk: int = bk, warps: int = warps,
                 stages: int = stages) -> None:
            w, s = ws
            _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
                x, w, s, x_scale, None, y, 1, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0),
                FP8_LIMIT=448.0, QUANT_X=True, HAS_BIAS=False, PACKED=False, BLOCK_M=1, BLOCK_N=bn, BLOCK_K=bk,
                num_warps=warps, num_stages=stages)

        rows.append((cycled_us(copies, call), tiles))
    return sorted(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time candidate FP8 GEMV tiles per shape at one row")
    p.add_argument("--shapes", nargs="*", default=list(SHAPES), help=f"of {list(SHAPES)}")
    args = p.parse_args(argv)
    bandwidth = measure_rates(torch.device("cuda"), torch.bfloat16)["copy_bytes_per_s"]
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s")
    print("fp8 GEMV: FP8 loads widened by conversion instructions (the default); packed: int32 words widened by "
          "integer ops (packed=True)")
    print(f"{'projection':14s} {'rows':>4s} {'bf16 cuBLAS':>11s} {'bf16 GEMV':>9s} {'fp8 GEMV':>8s} {'packed':>9s} "
          f"{'scaled_mm':>9s} {'fp8 GEMV roof':>13s} {'vs best bf16':>12s}")
    for name in args.shapes:
        k, n = SHAPES[name]
        bf16 = weight_copies(n, k)
        fp8 = fp8_copies(n, k)
        for rows in ROWS:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            x_scale = torch.tensor(x.abs().max().item() / 448, device="cuda")
            t_cublas = cycled_us(bf16, lambda w: F.linear(x, w))  # noqa: B023
            t_gemv = cycled_us(bf16, lambda w: gemv_triton(x, w)) if rows == 1 else float("nan")  # noqa: B023
            t_fp8 = cycled_us(fp8, lambda ws: fp8_gemv_triton(x, ws[0], ws[1], x_scale))  # noqa: B023
            t_packed = cycled_us(fp8, lambda ws: fp8_gemv_triton(x, ws[0], ws[1], x_scale, packed=True))  # noqa: B023
            t_mm: float | str = "-"
            if n % 16 == 0 and k % 16 == 0:
                t_mm = cycled_us(fp8, lambda ws: fp8_scaled_mm(x, ws[0], ws[1], x_scale))  # noqa: B023
            floor_us = n * k / bandwidth * 1e6
            best_bf16 = min(t_cublas, t_gemv) if rows == 1 else t_cublas
            mm = f"{t_mm:9.1f}" if isinstance(t_mm, float) else f"{t_mm:>9s}"
            print(f"{name:14s} {rows:4d} {t_cublas:11.1f} {t_gemv:9.1f} {t_fp8:8.1f} {t_packed:9.1f} {mm} "
                  f"{floor_us / t_fp8:13.0%} {best_bf16 / t_fp8:11.2f}x", flush=True)
        if args.sweep:
            x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
            found = sweep_shape(fp8, x, torch.tensor(x.abs().max().item() / 448, device="cuda"))
            best = ", ".join(f"{us:.1f} us {bn}x{bk} w{w} s{st}" for us, (bn, bk, w, st) in found[:4])
            print(f"sweep {name}: fp8_gemv_tiles {fp8_gemv_tiles(1, k)[1:]}; best {best}", flush=True)
        del bf16, fp8


if __name__ == "__main__":
    main()
