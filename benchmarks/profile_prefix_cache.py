"""Where prefix caching's modes spend time on prompts that share nothing: one unique wave per
(backend, mamba_cache_mode) under torch.profiler, from `bench_prefix_cache`'s workload and engines.

Per configuration it prints the wave's wall time, prefill steps and GPU kernel time; then, per
backend, the GPU kernels (CUDA) or host operators (CPU) whose time differs most between `none`
and the caching modes: what `align` / `all` add to a wave that can never hit.

    python benchmarks/profile_prefix_cache.py --device cuda --size nemotron-h-8b --requests 32 --prefix 1024
    python benchmarks/profile_prefix_cache.py                                  # CPU, tiny: seconds
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_prefix_cache import make_engine, prompts, run_lockstep, run_wave  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

MODES = ("none", "align", "all")


def profile_wave(engine, wave: list[list[int]], max_tokens: int, cuda: bool) -> dict:
    """One wave under the profiler: wall, prefill steps, and ms per kernel (CUDA) or operator (CPU)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        _, clock, _, split = run_lockstep({None: engine}, wave, max_tokens)[None]
    by_name: Counter = Counter()
    if cuda:
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:
                by_name[e.name[:80]] += e.time_range.elapsed_us() / 1e3
    else:
        for e in prof.key_averages():
            by_name[e.key[:80]] += e.self_cpu_time_total / 1e3
    return {"wall_ms": 1e3 * clock, "prefill_steps": split[0], "prefill_ms": 1e3 * split[1],
            "total_ms": sum(by_name.values()), "by_name": by_name}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--backends", nargs="+", default=["baseline", "replay"])
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prefix", type=int, default=256)
    parser.add_argument("--state-slots", type=int, default=2)
    parser.add_argument("--rows", type=int, default=15, help="kernels / operators shown per backend")
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = "bfloat16" if cuda else "float32"
    args.suffix, args.max_tokens, args.block_size, args.budget = 32, 32, 16, 2048
    model = random_model(model_config(args.size), getattr(torch, args.dtype), args.device, seed=0)
    unit = "GPU kernel" if cuda else "host operator (self)"
    out = {}
    for backend in args.backends:
        results = out[backend] = {}
        for mode in MODES:
            engine = make_engine(model, args, backend, "on", mode)
            vocab = engine.config.model.vocab_size
            run_wave(engine, prompts(2, args.prefix, args.suffix, False, vocab, seed=1), 4)  # compiles, warms
            wave = prompts(args.requests, args.prefix, args.suffix, False, vocab, seed=5)
            results[mode] = profile_wave(engine, wave, args.max_tokens, cuda)
            r = results[mode]
            print(f"{backend} {mode}: wall {r['wall_ms']:.1f} ms (profiled), {r['prefill_steps']} prefill steps, "
                  f"prefill {r['prefill_ms']:.1f} ms, {unit} total {r['total_ms']:.1f} ms", flush=True)
            del engine
            if cuda:
                torch.cuda.empty_cache()
        names = set().union(*(r["by_name"] for r in results.values()))
        extra = {n: max(results[m]["by_name"][n] for m in MODES[1:]) - results["none"]["by_name"][n] for n in names}
        print(f"\n{backend}: {unit} ms per wave, largest differences to none")
        print("| name | none | align | all |\n|---|---:|---:|---:|")
        for n in sorted(names, key=lambda n: -abs(extra[n]))[:args.rows]:
            print(f"| {n} | " + " | ".join(f"{results[m]['by_name'][n]:.2f}" for m in MODES) + " |")
        print("| total | " + " | ".join(f"{results[m]['total_ms']:.1f}" for m in MODES) + " |\n", flush=True)
    return out


if __name__ == "__main__":
    main()
