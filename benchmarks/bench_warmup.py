"""Startup and the first waves of a fresh engine, with and without the warm-up (`Engine.warm_up`).

A random-weight model of a named shape is built on the device, an engine on it (`LLM`'s defaults:
64 sequences, a 2048-token budget), then, unless `--no-warmup`, the warm-up runs; then `--waves`
waves of `--prompts` requests (`--prompt-len` random tokens, `--output-len` greedy tokens, EOS
ignored), each served to completion. Per wave: seconds, output tokens/s, and what it compiled or
captured on the way (Triton kernel variants, by Triton's cache-miss hook: its in-memory cache, so
a variant loaded from the disk cache counts too; decode graphs). A warmed engine's first wave should
run as fast as its second and compile nothing. One configuration per process, so that no earlier
engine has compiled anything in it; for a cold start point TRITON_CACHE_DIR at an empty directory.

    for b in baseline replay; do for w in "" --no-warmup; do
        python benchmarks/bench_warmup.py --device cuda --size nemotron-h-8b --backend $b $w; done; done

Prints one JSON object (and writes it to `--out`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import BACKENDS, DTYPES, random_prompts, ssm_backend, sync_fn  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve.config import EngineConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--size", choices=sorted(SIZES), default="nemotron-h-8b")
    p.add_argument("--backend", choices=BACKENDS, default="replay")
    p.add_argument("--no-warmup", action="store_true", help="serve the waves from a cold engine")
    p.add_argument("--prompts", type=int, default=64, help="requests per wave, also max_num_seqs (default 64)")
    p.add_argument("--prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens (default 2048)")
    p.add_argument("--waves", type=int, default=2)
    p.add_argument("--list-compiles", action="store_true", help="name each kernel variant a wave compiled")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    return args


def _compile_log() -> list[str]:
    """Names of the Triton kernel variants missing from the in-memory cache from now on (CUDA)."""
    log: list[str] = []
    if torch.cuda.is_available():
        import triton

        triton.knobs.runtime.jit_cache_hook = lambda **info: log.append(info["repr"])
    return log


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    sync = sync_fn(device)
    compiled = _compile_log()
    start = time.perf_counter()
    model = random_model(model_config(args.size), DTYPES[args.dtype], device, seed=args.seed)
    sync()
    built = time.perf_counter()
    config = EngineConfig(model=model.config, dtype=args.dtype, device=args.device, max_num_seqs=args.prompts,
                          max_num_batched_tokens=args.budget, max_model_len=args.prompt_len + args.output_len,
                          ssm_backend=ssm_backend(args.backend), enforce_eager=args.backend.endswith("-eager"),
                          async_scheduling=args.backend.endswith("-async"))
    engine = Engine(config, model, tokenizer=None)
    sync()
    engined = time.perf_counter()
    report = None if args.no_warmup else engine.warm_up()
    sync()
    ready = time.perf_counter()
    graphs = engine.runner.graphs
    result: dict = {"meta": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                    "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                    "model_s": built - start, "engine_s": engined - built, "warmup_s": ready - engined,
                    "startup_compiles": len(compiled), "warmup": None if report is None else report.describe(),
                    "waves": []}
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for wave in range(args.waves):
        compiled.clear()
        captured = len(graphs._graphs) if graphs is not None else 0
        prompts = random_prompts(args.prompts, args.prompt_len, model.config.vocab_size, args.seed + 1 + wave)
        t0 = time.perf_counter()
        for prompt in prompts:
            engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        sync()
        seconds = time.perf_counter() - t0
        row = {"wave": wave + 1, "seconds": seconds, "output_tok_s": args.prompts * args.output_len / seconds,
               "compiles": len(compiled),
               "graphs_captured": (len(graphs._graphs) if graphs is not None else 0) - captured}
        if args.list_compiles:
            row["compiled"] = list(compiled)
        result["waves"].append(row)
        print(f"wave {wave + 1}: {seconds:.2f} s, {row['output_tok_s']:.0f} output tok/s, "
              f"{row['compiles']} kernel variants compiled, {row['graphs_captured']} graphs captured",
              file=sys.stderr, flush=True)
    first, *rest = result["waves"]
    if rest:
        result["first_over_second"] = first["seconds"] / rest[0]["seconds"]
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
