"""One-row bf16 linear: cuBLAS (``F.linear``) against ``ops/gemv_triton.gemv_triton``, in a CUDA graph.

Rows: the Nemotron-3-Nano and Nemotron-H-8B projections at batch-1 decode. Each is timed as 20
calls captured in one graph, median of 10 replays, and its weight-read rate is printed against
the device copy bandwidth (the roofline of a GEMV: it reads each weight once).

    python benchmarks/bench_gemv.py        # CUDA only, ~20 s
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from replayserve.ops.gemv_triton import gemv_triton

SHAPES = {"nano in_proj": (2688, 10304), "nano out_proj": (4096, 2688), "nano qkv": (2688, 4608),
          "nano lm_head": (2688, 131072), "8b in_proj": (4096, 18560), "8b up": (4096, 21504),
          "8b down": (21504, 4096)}


def graphed_us(fn, calls: int = 20, replays: int = 10) -> float:  # noqa: ANN001
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


def copy_bandwidth() -> float:
    """Bytes per second of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / (graphed_us(lambda: dst.copy_(src), calls=5) * 1e-6)


def main() -> None:
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy {bandwidth / 1e9:.0f} GB/s")
    print(f"{'projection':14s} {'K x N':>13s} {'cuBLAS us':>10s} {'GEMV us':>8s} {'ratio':>6s} "
          f"{'cuBLAS roof':>11s} {'GEMV roof':>9s}")
    for name, (k, n) in SHAPES.items():
        weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        t_cublas = graphed_us(lambda: F.linear(x, weight))  # noqa: B023
        t_gemv = graphed_us(lambda: gemv_triton(x, weight))  # noqa: B023
        floor_us = weight.numel() * 2 / bandwidth * 1e6
        print(f"{name:14s} {f'{k}x{n}':>13s} {t_cublas:10.1f} {t_gemv:8.1f} {t_cublas / t_gemv:5.2f}x "
              f"{floor_us / t_cublas:10.0%} {floor_us / t_gemv:9.0%}")


if __name__ == "__main__":
    main()
