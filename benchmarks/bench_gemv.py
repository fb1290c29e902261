"""One-row bf16 linear: cuBLAS (``F.linear``) against ``ops/gemv_triton.gemv_triton``, in a CUDA graph.

Rows: the Nemotron-3-Nano and Nemotron-H-8B projections at batch-1 decode. Each is timed as calls
captured in one graph, median of 10 replays, cycling through copies of the weight that together
exceed the L2 cache, so every call reads its weight from DRAM as the decode step does (one weight
alone, called again and again, would be served from L2 where it fits). Its weight-read rate is
printed against the device copy bandwidth (the roofline of a GEMV: it reads each weight once).
`--sweep` times the GEMV kernel under candidate tiles per shape and prints the best beside the
tiles `gemv_tiles` picks (the study behind them).

    python benchmarks/bench_gemv.py            # CUDA only, ~20 s
    python benchmarks/bench_gemv.py --sweep    # + 158 tilings per shape, ~2 min
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import measure_rates  # noqa: E402

from replayserve.ops.gemv_triton import _gemv_kernel, gemv_tiles, gemv_triton  # noqa: E402

SHAPES = {"nano in_proj": (2688, 10304), "nano out_proj": (4096, 2688), "nano qkv": (2688, 4608),
          "nano lm_head": (2688, 131072), "8b in_proj": (4096, 18560), "8b up": (4096, 21504),
          "8b down": (21504, 4096)}
# Candidate tiles of the sweep: rows per program, K step, warps, pipeline stages.
SWEEP = [(bn, bk, w, st) for bn, bk, w, st in itertools.product([1, 2, 4, 8, 16], [128, 256, 512, 1024], [1, 2, 4, 8],
                                                                 [1, 3]) if 32 * w <= bn * bk <= 16384]


def graphed_us(fn: Callable[[], object], calls: int = 20, replays: int = 10) -> float:
    """Microseconds per call of `fn`, `calls` of it captured in one graph; median of `replays`."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return sorted(times)[len(times) // 2]


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Copies of an (n, k) bf16 weight whose total is at least twice the L2 cache (and 8 calls)."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    count = max(1, -(-2 * l2 // (n * k * 2)))
    return [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(count)]


def cycled_us(weights: list[torch.Tensor], call: Callable[[torch.Tensor], object]) -> float:
    """graphed_us of `call` over the weights in turn, at least 8 calls a graph."""
    order = itertools.cycle(weights)
    return graphed_us(lambda: call(next(order)), calls=len(weights) * max(1, -(-8 // len(weights))))


def sweep_shape(weights: list[torch.Tensor], x: torch.Tensor) -> list[tuple[float, tuple[int, int, int, int]]]:
    """(us, (BLOCK_N, BLOCK_K, warps, stages)) of every candidate, fastest first."""
    n, k = weights[0].shape
    y = torch.empty(1, n, device="cuda", dtype=x.dtype)
    rows = []
    for tiles in SWEEP:
        bn, bk, warps, stages = tiles

        def call(w: torch.Tensor, bn: int = bn, bk: int = bk, warps: int = warps, stages: int = stages) -> None:
            _gemv_kernel[(triton.cdiv(n, bn),)](
                x, w, None, y, n, k, x.stride(1), w.stride(0), w.stride(1), *(None,) * 4, 0, 0, 0, 0, 0, 0, 0,
                HAS_BIAS=False, HAS_CONV=False, HAS_CONV_BIAS=False, CONV_K=2, BLOCK_N=bn, BLOCK_K=bk, BLOCK_U=1,
                num_warps=warps, num_stages=stages)

        rows.append((cycled_us(weights, call), tiles))
    return sorted(rows)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweep", action="store_true", help="time candidate GEMV tiles per shape")
    args = p.parse_args(argv)
    bandwidth = measure_rates(torch.device("cuda"), torch.bfloat16)["copy_bytes_per_s"]
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s")
    print(f"{'projection':14s} {'K x N':>13s} {'cuBLAS us':>10s} {'GEMV us':>8s} {'ratio':>6s} "
          f"{'cuBLAS roof':>11s} {'GEMV roof':>9s}")
    sweeps = {}
    for name, (k, n) in SHAPES.items():
        weights = weight_copies(n, k)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t_cublas = cycled_us(weights, lambda w: F.linear(x, w))  # noqa: B023
        t_gemv = cycled_us(weights, lambda w: gemv_triton(x, w))  # noqa: B023
        floor_us = n * k * 2 / bandwidth * 1e6
        print(f"{name:14s} {f'{k}x{n}':>13s} {t_cublas:10.1f} {t_gemv:8.1f} {t_cublas / t_gemv:5.2f}x "
              f"{floor_us / t_cublas:10.0%} {floor_us / t_gemv:9.0%}", flush=True)
        if args.sweep:
            sweeps[name] = (sweep_shape(weights, x), t_gemv, gemv_tiles(k))
        del weights
    for name, (rows, t_gemv, picked) in sweeps.items():
        best = ", ".join(f"{us:.1f} us {bn}x{bk} w{w} s{st}" for us, (bn, bk, w, st) in rows[:3])
        print(f"sweep {name}: gemv_tiles {picked} {t_gemv:.1f} us; best {best}")


if __name__ == "__main__":
    main()
