"""One MoE layer of a named shape, fused (Triton) against the reference (per-expert loop), per token count.

For each T the layer runs on the same random input through both paths (after the comparison of
their outputs) and is timed with CUDA events: the fused path eagerly and replayed as a CUDA graph
(the decode path), the reference eagerly; where the shared expert folds into the grouped GEMM
(`MoE.num_folded`, up to `FOLD_SHARED_MAX_TOKENS`), "unfolded" is the graphed call with it on cuBLAS.
Each row prints the microseconds per call, the bytes a call must read at least (the router, the
shared expert and the experts the batch routes to, each once) against the copy bandwidth measured
in the same run, and the FLOPs against the measured bf16 matmul rate.

    python benchmarks/bench_moe.py                                       # H200: under a minute
    python benchmarks/bench_moe.py --tokens 1 64 256 16384 --size medium --out DIR
    python benchmarks/bench_moe.py --sweep                               # + GEMM tiles per T: minutes

`--fp8` quantizes the experts (routed and shared, latent projections aside) in memory as bench_e2e's
`--quantization fp8` does: the grouped GEMMs then read float8_e4m3fn stacks with per-expert
scales; their bytes count 1 a weight.
For FP8 against bf16, run it twice (`--out` two directories), or on one warm card:

    python benchmarks/bench_moe.py --tokens 1 8 64 --no-ref && python benchmarks/bench_moe.py --tokens 1 8 64 --fp8

`--sweep` times the routed experts alone (`fused_moe_triton`, graphed) under each candidate
`GemmConfig` and prints the best beside `default_config`'s (through `config_for`), to retune that function.
`--profile` prints, per T, the GPU kernels of the graphed layer (torch.profiler over 20 replays):
where a decode-size call's time goes besides the grouped GEMMs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import measure_rates, median_seconds  # noqa: E402
from shapes import SIZES, model_config  # noqa: E402

from replayserve.config import ModelConfig  # noqa: E402
from replayserve.layers import mlp  # noqa: E402
from replayserve.layers.mlp import MoE  # noqa: E402
from replayserve.models.fp8_loading import quantize_model_fp8  # noqa: E402
from replayserve.models.quantization import QuantConfig  # noqa: E402
from replayserve.ops.moe import fused_moe_ref  # noqa: E402
from replayserve.ops.moe_triton import GemmConfig, config_for, fused_moe_triton  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(SIZES), default="nemotron-3-nano-30b-a3b")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 256, 1024, 4096, 16384])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--no-ref", action="store_true", help="skip the reference loop (slow at large T)")
    p.add_argument("--fp8", action="store_true", help="FP8 experts (per-expert scales), quantized in memory")
    p.add_argument("--sweep", action="store_true", help="time candidate GEMM tiles per T")
    p.add_argument("--profile", action="store_true", help="the graphed layer's kernels per T")
    p.add_argument("--out", type=Path, help="write bench_moe.json here")
    return p.parse_args(argv)


@torch.no_grad()
def random_moe(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> MoE:
    """A MoE layer of `cfg` with fan-in scaled random weights, the router in fp32 as models keep it."""
    with torch.device("meta"):
        moe = MoE(cfg)
    moe.to_empty(device=device).to(dtype)
    moe.gate.float()
    gen = torch.Generator(device=device).manual_seed(0)
    for p in moe.parameters():
        p.normal_(0.0, 1.5 / p.shape[-1] ** 0.5, generator=gen)
    moe.gate.e_score_correction_bias.zero_()
    moe.stacked_experts()
    return moe


def graphed(fn: Callable[[], torch.Tensor]) -> Callable[[], None]:
    """`fn` captured in a CUDA graph (after a warm-up that compiles its kernels); returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def bytes_and_flops(moe: MoE, x: torch.Tensor) -> tuple[int, int, int]:
    """(bytes read at least, FLOPs, experts used) of one call on x (T, hidden)."""
    ids, _ = moe.gate(x)
    used = len(ids.unique())
    w_up, _ = moe.stacked_experts()
    expert = 2 * w_up[0].numel()
    shared = list(moe.shared_experts.parameters())
    latent = [p for m in (moe.fc1_latent_proj, moe.fc2_latent_proj) for p in m.parameters()]
    router = moe.gate.weight.numel() * moe.gate.weight.element_size()
    io = 2 * x.numel() * x.element_size()
    flops = 2 * x.shape[0] * (ids.shape[1] * expert + sum(p.numel() for p in shared + latent))
    dense = sum(p.numel() * p.element_size() for p in shared + latent)
    return used * expert * w_up.element_size() + dense + router + io, flops, used


def reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE layer's CPU path (the per-expert loop) on x's device."""
    ids, weights = moe.gate(x)
    num = len(moe.experts)  # the stacks end with the shared expert's pseudo-experts when it folds
    w_up, w_down = moe.stacked_experts()
    routed = fused_moe_ref(moe.fc1_latent_proj(x), w_up[:num], w_down[:num], ids.long(), weights,
                           scales=moe.expert_scales(num))
    return moe.fc2_latent_proj(routed.to(x.dtype)) + moe.shared_experts(x)


def measure(moe: MoE, x: torch.Tensor, rates: dict[str, float], args: argparse.Namespace) -> dict:
    """One row: x (T, hidden) through the fused path (eager and graphed) and the reference."""
    nbytes, flops, used = bytes_and_flops(moe, x)
    fused_s = median_seconds(lambda: moe(x), x.device, args.reps)
    graph_s = median_seconds(graphed(lambda: moe(x)), x.device, args.reps)
    folds = moe.num_folded and x.shape[0] <= mlp.FOLD_SHARED_MAX_TOKENS
    unfolded_s = float("nan")
    if folds:  # the same call with the shared expert on cuBLAS, beside the routed experts' kernels
        limit, mlp.FOLD_SHARED_MAX_TOKENS = mlp.FOLD_SHARED_MAX_TOKENS, 0
        unfolded_s = median_seconds(graphed(lambda: moe(x)), x.device, args.reps)
        mlp.FOLD_SHARED_MAX_TOKENS = limit
    best = min(fused_s, graph_s)
    row = {"tokens": x.shape[0], "experts_used": used, "fused_us": fused_s * 1e6, "graph_us": graph_s * 1e6,
           "shared_folded": bool(folds), "unfolded_graph_us": unfolded_s * 1e6,
           "bytes": nbytes, "flops": flops, "bytes_share": nbytes / rates["copy_bytes_per_s"] / best,
           "flops_share": flops / rates["matmul_flop_per_s"] / best, "ref_us": float("nan"),
           "max_rel_err": float("nan")}
    if not args.no_ref:
        want = reference(moe, x).float()
        row["max_rel_err"] = ((moe(x).float() - want).abs().max() / want.abs().max()).item()
        row["ref_us"] = median_seconds(lambda: reference(moe, x), x.device, max(3, args.reps // 4)) * 1e6
    print(f"{x.shape[0]:>6} {used:>7} {fused_s * 1e6:>9.1f} {graph_s * 1e6:>9.1f} {unfolded_s * 1e6:>9.1f} "
          f"{row['ref_us']:>9.1f} "
          f"{row['ref_us'] / (best * 1e6):>9.2f} {100 * row['bytes_share']:>7.1f}% {100 * row['flops_share']:>7.1f}% "
          f"{row['max_rel_err']:>9.2e}", flush=True)
    return row


def sweep(moe: MoE, x: torch.Tensor, reps: int) -> dict:
    """The routed experts on x (T, hidden) under each candidate tile config: the default's time and
    the best's, in microseconds."""
    ids, weights = moe.gate(x)
    w_up, w_down = (w[:len(moe.experts)] for w in moe.stacked_experts())
    scales = moe.expert_scales(len(moe.experts))
    default = config_for(x, w_up, w_down, ids.numel(), w_up.shape[0])
    times: dict[GemmConfig, float] = {}
    for config in {default, *candidates(default.block_m)}:
        try:
            run = graphed(lambda c=config: fused_moe_triton(x, w_up, w_down, ids, weights, config=c, scales=scales))
        except Exception as e:  # noqa: BLE001 - a tile that does not fit (shared memory) is skipped
            print(f"  skipped {config}: {type(e).__name__}", file=sys.stderr)
            continue
        times[config] = median_seconds(run, x.device, reps) * 1e6
    best = min(times, key=times.__getitem__)
    print(f"  T={x.shape[0]}: default {times[default]:.1f} us {default}; best {times[best]:.1f} us {best}", flush=True)
    return {"tokens": x.shape[0], "default_us": times[default], "best_us": times[best], "best": vars(best)}


def profile_kernels(moe: MoE, x: torch.Tensor, replays: int = 20) -> dict[str, float]:
    """Microseconds per call of each GPU kernel of the graphed layer on x, largest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    run = graphed(lambda: moe(x))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            run()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            kernels[e.name[:70]] = kernels.get(e.name[:70], 0.0) + e.time_range.elapsed_us() / replays
    kernels = dict(sorted(kernels.items(), key=lambda kv: -kv[1]))
    print(f"  T={x.shape[0]}: {sum(kernels.values()):.1f} us of kernels a call", flush=True)
    for name, us in kernels.items():
        print(f"    {us:8.1f} us  {name}", flush=True)
    return kernels


def candidates(block_m: int) -> list[GemmConfig]:
    """Tiles around a default block_m: half to twice it, 16 to 128; 16-row (decode) tiles also swapped
    (``GemmConfig.swap_ab``: the weight tile as the dot's left operand)."""
    ms = sorted({m for m in (block_m // 2, block_m, 2 * block_m) if 16 <= m <= 128})
    return [GemmConfig(m, n, k, w, st, swap) for m in ms for n in (16, 32, 64, 128) for k in (64, 128, 256)
            for w in (4, 8) for st in (3, 4) for swap in ((False, True) if m == 16 else (False,))]


@torch.no_grad()
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device("cuda")
    dtype = DTYPES[args.dtype]
    cfg = model_config(args.size)
    moe = random_moe(cfg, dtype, device)
    if args.fp8:
        # the latent projections stay 16-bit, as in NVIDIA's recipe (bench_e2e's rule)
        quantize_model_fp8(moe, QuantConfig("FP8", None, ("fc1_latent_proj", "fc2_latent_proj"), "--fp8"))
    rates = measure_rates(device, dtype)
    kind = " FP8 experts" if args.fp8 else ""
    print(f"{args.size}{kind}: {cfg.n_routed_experts} experts of {cfg.moe_intermediate_size}, "
          f"top-{cfg.num_experts_per_tok}, "
          f"hidden {cfg.hidden_size}; copy {rates['copy_bytes_per_s'] / 1e9:.0f} GB/s, "
          f"matmul {rates['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s")
    print(f"{'T':>6} {'experts':>7} {'fused us':>9} {'graph us':>9} {'unfolded':>9} {'ref us':>9} {'ref/fused':>9} "
          f"{'bytes %':>8} {'FLOPs %':>8} {'max err':>9}")
    rows = [measure(moe, torch.randn(t, cfg.hidden_size, device=device, dtype=dtype), rates, args) for t in args.tokens]
    sweeps = [sweep(moe, torch.randn(t, cfg.hidden_size, device=device, dtype=dtype), args.reps)
              for t in (args.tokens if args.sweep else [])]
    profiles = [profile_kernels(moe, torch.randn(t, cfg.hidden_size, device=device, dtype=dtype))
                for t in (args.tokens if args.profile else [])]
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_moe.json").write_text(json.dumps({"size": args.size, "dtype": args.dtype, "fp8": args.fp8,
                                                             "rates": rates,
                                                             "rows": rows, "sweeps": sweeps, "profiles": profiles},
                                                            indent=2))
    return rows


if __name__ == "__main__":
    main()
