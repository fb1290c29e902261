"""Decode throughput under tensor parallelism, and the collectives' share of a step.

A random-weight model of a named shape is written once as a Hugging Face checkpoint (each rank
loads its slice of it, as from a real model); for each `--tp` an `LLM(tensor_parallel_size=N)`
is built, and for each batch size `batch` prompts of `--prompt-len` tokens are prefilled,
`--warmup` decode steps run, then `--repeats` windows of `--steps` steps are timed through
`llm.engine.step()` (medians reported). `--profile-steps` more run under `torch.profiler` on rank 0:
the time in collectives per step (NCCL kernels on CUDA; gloo's all-reduce / all-gather calls on
the CPU) and its share of the profiled steps' wall time. "vs TP=1" is the throughput ratio to the
first `--tp` of the run at the same batch. On CUDA rank r runs on `cuda:r` (NCCL), so N ranks
need N GPUs; on the CPU the ranks are processes on one host (gloo).

    python benchmarks/bench_tp.py --device cuda --size nemotron-h-8b --tp 1 2 --out DIR   # 2 GPUs
    python benchmarks/bench_tp.py --device cpu --size tiny --tp 1 2                       # seconds

The roofline of a TP row is its TP=1 row's (`bench_e2e.py`) divided by N: each rank reads 1/N of
the weights (norms, routers and the replicated KV heads aside), plus the all-reduces.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import random_prompts, sync_fn, timed_windows  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve import LLM  # noqa: E402
from replayserve.models.writer import save_model  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
COLLECTIVES = ("nccl", "allreduce", "all_reduce", "allgather", "all_gather")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", choices=sorted(SIZES), default="nemotron-h-8b")
    p.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes, compared in one run")
    p.add_argument("--batch", type=int, nargs="+", help="decode batch sizes (default 1 16 64 256; CPU 1 4)")
    p.add_argument("--backend", choices=("baseline", "replay"), default="replay")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile-steps", type=int, default=4)
    p.add_argument("--model-dir", type=Path, help="write (or reuse) the random checkpoint here")
    p.add_argument("--out", type=Path, help="directory for bench_tp.json")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.batch = args.batch or ([1, 16, 64, 256] if args.device.startswith("cuda") else [1, 4])
    return args


def write_checkpoint(args: argparse.Namespace, out: Path) -> Path:
    """The random model of `--size` as config.json + safetensors in `out` (kept if already there)."""
    if (out / "config.json").is_file():
        return out
    device = "cuda" if args.device.startswith("cuda") else "cpu"  # drawn on the GPU: the CPU takes minutes at 8B
    model = random_model(model_config(args.size), DTYPES[args.dtype], device, fold=False)
    save_model(model, out, DTYPES[args.dtype], max_shard_bytes=4 << 30)
    del model
    return out


def collective_ms(steps: int, run: Callable[[], float], device: torch.device) -> dict:
    """Rank 0's time in collectives per step over `steps` profiled steps (`run` runs them and
    returns their wall seconds), and its share of that wall time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = run()  # timed_windows keeps the collector off
    # NCCL runs as kernels on the GPU; gloo's collectives are CPU-side calls (their outermost op).
    kind = DeviceType.CUDA if device.type == "cuda" else DeviceType.CPU
    events = [e for e in prof.events() if e.device_type == kind and any(c in e.name.lower() for c in COLLECTIVES)]
    if kind == DeviceType.CPU:  # nested calls of one collective would count twice
        events = [e for e in events if not any(c in (e.cpu_parent.name.lower() if e.cpu_parent else "")
                                               for c in COLLECTIVES)]
    ms = sum(e.time_range.elapsed_us() for e in events) / 1e3 / steps
    return {"collective_ms_per_step": ms, "collective_share": ms / (1e3 * wall / steps),
            "collectives_per_step": len(events) / steps}


def decode_rows(llm: LLM, args: argparse.Namespace, tp: int) -> list[dict]:
    engine, device = llm.engine, torch.device(llm.config.device)
    sync, rows = sync_fn(device), []
    for batch in args.batch:
        total = args.warmup + args.repeats * args.steps + args.profile_steps
        params = SamplingParams(temperature=0.0, max_tokens=total + 64, ignore_eos=True)
        prompts = random_prompts(batch, args.prompt_len, llm.config.model.vocab_size, seed=batch)
        requests = [engine.add_request(p, params) for p in prompts]
        while not all(r.decoding for r in requests):
            engine.step()
        for _ in range(args.warmup):
            engine.step()
        walls = timed_windows(engine, args.repeats, args.steps, sync)
        row = {"tp": tp, "batch": batch, "walls_s": walls}
        if args.profile_steps:
            row.update(collective_ms(args.profile_steps, lambda: timed_windows(engine, 1, args.profile_steps, sync)[0],
                                     device))
        for r in requests:
            engine.abort(r)
        wall = statistics.median(walls)
        row.update({"tok_s": batch * args.steps / wall, "step_ms": 1e3 * wall / args.steps})
        rows.append(row)
        print(f"  tp {tp} batch {batch}: {row['tok_s']:.1f} tok/s", flush=True)
    return rows


def print_table(rows: list[dict], args: argparse.Namespace) -> None:
    first = {r["batch"]: r for r in rows if r["tp"] == args.tp[0]}
    print(f"\n{args.size}, {args.dtype} on {args.device}, {args.backend}; {args.prompt_len}-token prompts, "
          f"medians of {args.repeats} x {args.steps} steps\n")
    print(f"| TP | batch | tok/s | step ms | vs TP={args.tp[0]} | collectives ms/step | share of step | calls/step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        base = first.get(r["batch"])
        ratio = f"{r['tok_s'] / base['tok_s']:.2f}x" if base else "-"
        coll = ("-", "-", "-") if "collective_ms_per_step" not in r else (
            f"{r['collective_ms_per_step']:.2f}", f"{100 * r['collective_share']:.0f}%",
            f"{r['collectives_per_step']:.0f}")
        print(f"| {r['tp']} | {r['batch']} | {r['tok_s']:.1f} | {r['step_ms']:.2f} | {ratio} | {' | '.join(coll)} |")


@torch.no_grad()
def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_checkpoint(args, args.model_dir or Path(tmp) / args.size)
        rows: list[dict] = []
        for tp in args.tp:
            seqs = max(args.batch)
            with LLM(str(model_dir), dtype=args.dtype, device=args.device, ssm_backend=args.backend,
                     max_num_seqs=seqs, max_num_batched_tokens=max(2048, 2 * seqs),
                     max_model_len=args.prompt_len + args.warmup + args.repeats * args.steps + args.profile_steps + 80,
                     tensor_parallel_size=tp) as llm:
                rows += decode_rows(llm, args, tp)
    print_table(rows, args)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bench_tp.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                           "rows": rows}, indent=2))
    return rows


if __name__ == "__main__":
    main()
