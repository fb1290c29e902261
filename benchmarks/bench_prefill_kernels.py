"""Packed varlen prefill kernels of one Mamba2 layer against their references, on CUDA.

Shapes: Nemotron-H-8B (H=128, P=64, N=128, G=8, chunk 128, conv_dim 10240, K=4), bf16 activations,
fp32 state; 16 sequences of 1024 tokens and one of 4096. Each kernel is first checked against the
float64 reference on the same (rounded) inputs, then timed (median of ``do_bench``) against the
reference as the engine runs it today (per sequence, fp32 einsums), with a per-kernel breakdown from
the profiler and tile variants of the scan. Byte counts are each tensor read or written once
(the fp32 chunk states: written, read and rewritten, read: four passes); FLOPs count the causal half
of the intra-chunk products.

    PYTHONPATH=$PWD python3 benchmarks/bench_prefill_kernels.py [--variants] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve.ops import ssd_triton  # noqa: E402
from replayserve.ops.conv1d import causal_conv1d_varlen_ref  # noqa: E402
from replayserve.ops.conv1d_varlen_triton import causal_conv1d_varlen_triton  # noqa: E402
from replayserve.ops.ssd import ssd_varlen_scan_ref  # noqa: E402

H, P, N, G, Q, K = 128, 64, 128, 8, 128, 4
CONV_DIM = H * P + 2 * G * N
ACT = torch.bfloat16
# Tile overrides of ``ssd_triton._tiles`` tried with --variants (bf16 defaults first).
VARIANTS = [
    {},
    {"warps": 8},
    {"scan_m": 128, "warps": 8},
    {"state_n": 128, "warps": 8},
    {"state_k": 128, "warps": 8},
    {"scan_p": 32},
]


def inputs(lens: list[int], seed: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def randn(*size: int, dtype: torch.dtype = ACT) -> torch.Tensor:
        return torch.randn(*size, generator=gen, device="cuda").to(dtype)

    xbc = randn(total, CONV_DIM)
    x, bc = xbc[:, : H * P].unflatten(1, (H, P)), xbc[:, H * P :]
    return {
        "xbc": xbc, "x": x, "B": bc[:, : G * N].unflatten(1, (G, N)), "C": bc[:, G * N :].unflatten(1, (G, N)),
        "dt": randn(total, H), "A": -torch.exp(randn(H, dtype=torch.float32) * 0.5),
        "D": randn(H, dtype=torch.float32), "dt_bias": randn(H, dtype=torch.float32) * 0.5,
        "pool": randn(len(lens) + 1, H, P, N, dtype=torch.float32), "slots": torch.arange(len(lens), device="cuda"),
        "conv_pool": randn(len(lens) + 1, CONV_DIM, K - 1), "weight": randn(CONV_DIM, K), "bias": randn(CONV_DIM),
        "cu": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda"),
        "phase": torch.zeros(len(lens), dtype=torch.int64, device="cuda"),
    }


def scan_args(inp: dict, cast=lambda t: t) -> tuple:  # noqa: ANN001 - the cast for the reference copy
    return (cast(inp["x"]), cast(inp["dt"]), cast(inp["A"]), cast(inp["B"]), cast(inp["C"]), Q, inp["cu"],
            inp["phase"])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def check(inp: dict) -> dict:
    """Relative L2 errors of the kernels' outputs and states against the float64 references."""
    pool, ref_pool = inp["pool"].clone(), inp["pool"].double()
    y, grid = ssd_triton.ssd_varlen_scan_triton(*scan_args(inp), pool, inp["slots"], inp["D"], inp["dt_bias"],
                                                return_grid_states=True)
    y_ref, grid_ref = ssd_varlen_scan_ref(*scan_args(inp, lambda t: t.double()), ref_pool, inp["slots"],
                                          inp["D"].double(), inp["dt_bias"].double(), return_grid_states=True)
    conv, ref_conv = inp["conv_pool"].clone(), inp["conv_pool"].double()
    yc = causal_conv1d_varlen_triton(inp["xbc"], inp["weight"], inp["bias"], conv, inp["slots"], inp["cu"])
    yc_ref = causal_conv1d_varlen_ref(inp["xbc"].double(), inp["weight"].double(), inp["bias"].double(), ref_conv,
                                      inp["slots"], inp["cu"])
    return {"scan_y": rel(y, y_ref), "scan_final": rel(pool, ref_pool), "scan_grid": rel(grid, grid_ref),
            "conv_y": rel(yc, yc_ref), "conv_state": rel(conv, ref_conv)}


def bench(fn, reps: int = 50) -> float:  # noqa: ANN001
    return triton.testing.do_bench(fn, warmup=25, rep=reps, return_mode="median")


def kernel_breakdown(fn) -> dict:  # noqa: ANN001
    """Mean device time per kernel name (us) over 5 calls, from the profiler."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 5, 1) for e in prof.key_averages() if e.device_time_total > 0}


def run(lens: list[int], variants: bool) -> dict:
    inp = inputs(lens, seed=len(lens))
    total = sum(lens)
    nchunks = sum(-(-n // Q) for n in lens)
    out = {"lens": f"{len(lens)}x{lens[0]}", "errors": check(inp)}
    chunks = ssd_triton.varlen_chunks(lens, [0] * len(lens), Q, "cuda")

    def scan() -> None:
        ssd_triton.ssd_varlen_scan_triton(*scan_args(inp), inp["pool"], inp["slots"], inp["D"], inp["dt_bias"],
                                          chunks=chunks)

    def scan_ref() -> None:
        ssd_varlen_scan_ref(*scan_args(inp), inp["pool"], inp["slots"], inp["D"], inp["dt_bias"])

    def conv() -> None:
        causal_conv1d_varlen_triton(inp["xbc"], inp["weight"], inp["bias"], inp["conv_pool"], inp["slots"], inp["cu"])

    def conv_ref() -> None:
        causal_conv1d_varlen_ref(inp["xbc"], inp["weight"], inp["bias"], inp["conv_pool"], inp["slots"], inp["cu"])

    scan_bytes = 2 * (3 * total * H * P + 2 * total * G * N + total * H) + 4 * nchunks * H * P * N * 4
    scan_flops = 4 * total * H * P * N + total * Q * H * (N + P)
    conv_bytes = 2 * 2 * total * CONV_DIM
    times = {"scan": bench(scan), "scan_ref": bench(scan_ref, reps=300), "conv": bench(conv),
             "conv_ref": bench(conv_ref, reps=300)}
    out["ms"] = {k: round(v, 4) for k, v in times.items()}
    out["scan_TB_s"] = round(scan_bytes / times["scan"] / 1e9, 2)
    out["scan_TFLOP_s"] = round(scan_flops / times["scan"] / 1e9, 1)
    out["conv_TB_s"] = round(conv_bytes / times["conv"] / 1e9, 2)
    try:
        out["scan_kernels_us"] = kernel_breakdown(scan)
    except Exception as e:  # the profiler is a convenience: its failure must not lose the timings
        out["scan_kernels_us"] = f"failed: {type(e).__name__}: {str(e)[:120]}"
    if variants:
        default = ssd_triton._tiles
        out["variants_ms"] = {}
        for v in VARIANTS:
            ssd_triton._tiles = lambda *a, v=v: {**default(*a), **v}
            try:
                out["variants_ms"][json.dumps(v)] = round(bench(scan), 4)
            except Exception as e:  # a tile that does not fit (shared memory, registers): report, go on
                out["variants_ms"][json.dumps(v)] = f"failed: {type(e).__name__}: {str(e)[:120]}"
            finally:
                ssd_triton._tiles = default
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variants", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)
    results = [run([1024] * 16, args.variants), run([4096], False)]
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    for r in results:
        print(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()
