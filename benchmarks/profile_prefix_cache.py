"""Where prefix caching's modes spend host time on prompts that share nothing: steps per wave and
the top operators of one profiled wave per (backend, mode), from `bench_prefix_cache`'s workload.

    python benchmarks/profile_prefix_cache.py [--device cuda] [--size medium] [--requests 32]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_prefix_cache import make_llm, prompts, run_wave  # noqa: E402
from shapes import LAYERS, SIZES  # noqa: E402

from replayserve.tiny import make_tiny  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--rows", type=int, default=15, help="operators shown per table")
    args = parser.parse_args()
    args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.suffix, args.max_tokens, args.block_size, args.budget = 32, 64, 16, 2048
    model_dir = make_tiny(tempfile.mkdtemp(), seed=0, layers=LAYERS[args.size], **SIZES[args.size])
    for backend in ("baseline", "replay"):
        for mode in ("none", "align", "all"):
            llm = make_llm(model_dir, args, backend, "on", mode)
            vocab = llm.config.model.vocab_size
            run_wave(llm, prompts(2, args.prefix, args.suffix, False, vocab, seed=1), 4)  # warm-up
            wave = prompts(args.requests, args.prefix, args.suffix, False, vocab, seed=5)
            steps = llm.get_metrics()["num_steps"]
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                ttft, wall, _ = run_wave(llm, wave, args.max_tokens)
            steps = llm.get_metrics()["num_steps"] - steps
            print(f"\n=== {backend} {mode}: wall {wall:.3f} s (profiled), {steps} steps, "
                  f"mean TTFT {sum(ttft) / len(ttft):.3f} s", flush=True)
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.rows, max_name_column_width=60))
            del llm


if __name__ == "__main__":
    main()
