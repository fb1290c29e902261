"""Shared-prefix serving workload: time to first token and throughput with prefix caching off vs
``mamba_cache_mode`` none / align / all, on both SSM backends; plus a workload with no shared
prefix, where caching can only cost (bookkeeping, boundary-state copies).

A wave of ``--requests`` prompts (one ``--prefix``-token system prompt + a ``--suffix``-token
question each) arrives at once after one warm-up request has served the system prompt. In a
round every configuration serves the same wave in lock-step: one engine step each in turn (the
order rotating), every step timed on its own up to a device sync, so that the machine's drift and
noise fall on all configurations alike. An engine's clock is the sum of its own step times: TTFT
per request is that clock at its first sampled token, throughput is generated tokens over the
clock at the end; both are medians over ``--repeats`` rounds; "vs none (paired)" is the median
over rounds of the throughput ratio to ``mamba_cache_mode='none'`` in the same round. Every
configuration is checked to produce the same greedy tokens as caching off. The model is a random
Nemotron-H of a named shape (`benchmarks/shapes.py`), built in memory on the device once and
shared by every engine (each engine owns its caches); each engine's KV blocks hold `--requests`
sequences, its boundary-state slots are `--state-slots` per request.

    python benchmarks/bench_prefix_cache.py [--device cuda] [--size medium] [--requests 32] [--out r.json]
    python benchmarks/bench_prefix_cache.py --device cuda --size nemotron-h-8b --requests 32 --prefix 1024 \
        --repeats 3                                                                   # H200: ~3 min
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve import SamplingParams  # noqa: E402
from replayserve.build import assemble_engine  # noqa: E402
from replayserve.config import EngineConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402

CONFIGS = [("off", "none"), ("on", "none"), ("on", "align"), ("on", "all")]


def prompts(n: int, prefix: int, suffix: int, shared: bool, vocab: int, seed: int) -> list[list[int]]:
    """n prompts: the system prompt (the same for every seed) or a unique head, then a question."""
    system = torch.randint(3, vocab, (prefix,), generator=torch.Generator().manual_seed(0)).tolist()
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        head = system if shared else torch.randint(3, vocab, (prefix,), generator=gen).tolist()
        out.append(head + torch.randint(3, vocab, (suffix,), generator=gen).tolist())
    return out


def run_wave(engine: Engine, wave: list[list[int]], max_tokens: int) -> tuple[list[float], float, list[list[int]]]:
    """TTFTs (s), wall time (s) and outputs of one wave submitted at once, served alone."""
    return run_lockstep({None: engine}, wave, max_tokens)[None][:3]


def run_lockstep(engines: dict, wave: list[list[int]], max_tokens: int) -> dict:
    """Every engine serves the wave, one step each in turn: {key: (TTFTs, clock, outputs, split)},
    where an engine's clock is the sum of its own step times (each step ends with a device sync,
    so no work of one engine runs into another's step) and split is (prefill steps, prefill
    seconds, decode seconds, device allocations): a step is a prefill step when any request still
    has prompt left; device allocations count the caching allocator's cudaMalloc calls and retries
    (a retry frees cached blocks, with a sync) during the engine's steps, read outside its clock.
    The garbage collector is off while the wave runs: its pauses would land on whichever
    engine's step they hit."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    device = next(iter(engines.values())).config.device
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    requests = {k: [engine.add_request(p, params) for p in wave] for k, engine in engines.items()}
    clock = dict.fromkeys(engines, 0.0)
    split = {k: [0, 0.0, 0.0, 0] for k in engines}
    cuda = device.startswith("cuda")

    def allocs() -> int:
        stats = torch.cuda.memory_stats() if cuda else {}
        return stats.get("num_device_alloc", 0) + stats.get("num_alloc_retries", 0)

    first: dict = {k: {} for k in engines}
    active, turn = list(engines), 0
    gc.collect()
    gc.disable()
    sync()
    try:
        while active:
            for k in active[turn % len(active):] + active[: turn % len(active)]:
                scheduler = engines[k].scheduler
                prefill = bool(scheduler.waiting) or any(not r.decoding for r in scheduler.running)
                before = allocs()
                t0 = time.perf_counter()
                engines[k].step()
                sync()
                took = time.perf_counter() - t0
                split[k][3] += allocs() - before
                clock[k] += took
                split[k][0] += prefill
                split[k][1 if prefill else 2] += took
                for r in requests[k]:
                    if r.output_token_ids and r.request_id not in first[k]:
                        first[k][r.request_id] = clock[k]
            active = [k for k in active if engines[k].has_unfinished()]
            turn += 1
    finally:
        gc.enable()
    return {k: ([first[k][r.request_id] for r in requests[k]], clock[k], [r.output_token_ids for r in requests[k]],
                tuple(split[k])) for k in engines}


def twin(records: list[dict], r: dict, caching: str, mode: str) -> dict:
    """The record of the same workload and backend with the given caching and mode."""
    return next(b for b in records if (b["backend"], b["shared"], b["caching"], b["mode"])
                == (r["backend"], r["shared"], caching, mode))


def make_engine(model: NemotronHForCausalLM, args: argparse.Namespace, backend: str, caching: str,
                mode: str) -> Engine:
    config = EngineConfig(model=model.config, dtype=args.dtype, device=args.device, max_num_seqs=args.requests,
                          max_num_batched_tokens=args.budget, block_size=args.block_size,
                          max_model_len=args.prefix + args.suffix + args.max_tokens + 16, ssm_backend=backend,
                          enable_prefix_caching=caching == "on", mamba_cache_mode=mode,
                          num_mamba_cache_slots=args.state_slots * args.requests if mode != "none" else None)
    return assemble_engine(config, model, tokenizer=None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prefix", type=int, default=512)
    parser.add_argument("--suffix", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--backends", nargs="+", default=["baseline", "replay"])
    parser.add_argument("--workloads", nargs="+", choices=["shared", "unique"], default=["shared", "unique"])
    parser.add_argument("--repeats", type=int, default=5, help="rounds of waves; medians are reported")
    parser.add_argument("--state-slots", type=int, default=4,
                        help="boundary-state slots per request (num_mamba_cache_slots / requests)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model = random_model(model_config(args.size), getattr(torch, args.dtype), args.device, seed=0)
    configs = [(backend, caching, mode) for backend in args.backends for caching, mode in CONFIGS]
    engines = {c: make_engine(model, args, *c) for c in configs}
    vocab = next(iter(engines.values())).config.model.vocab_size
    for engine in engines.values():  # compiles kernels, and serves the system prompt once
        run_wave(engine, prompts(1, args.prefix, args.suffix, True, vocab, seed=1), 2)
    records = []
    for shared in [w == "shared" for w in args.workloads]:
        samples: dict[tuple, list[tuple[float, float, tuple]]] = {c: [] for c in configs}
        outputs: dict[tuple, list[list[int]]] = {c: [] for c in configs}
        before = {c: engines[c].get_metrics() for c in configs}
        for rep in range(args.repeats):
            wave = prompts(args.requests, args.prefix, args.suffix, shared, vocab, seed=2 + rep)
            order = configs[rep % len(configs):] + configs[: rep % len(configs)]
            for c, (ttft, clock, outs, split) in run_lockstep({c: engines[c] for c in order}, wave,
                                                              args.max_tokens).items():
                samples[c].append((statistics.mean(ttft), clock, split))
                outputs[c] += outs
        for c in configs:
            m, m0 = engines[c].get_metrics(), before[c]
            queries = m["prefix_cache_queries"] - m0["prefix_cache_queries"]
            hits = m["prefix_cache_hits"] - m0["prefix_cache_hits"]
            walls = [w for _, w, _ in samples[c]]
            splits = [s for _, _, s in samples[c]]
            records.append({"backend": c[0], "caching": c[1], "mode": c[2], "shared": shared,
                            "ttft_mean_ms": 1e3 * statistics.median(t for t, _, _ in samples[c]),
                            "prefill_steps": statistics.median(s[0] for s in splits),
                            "prefill_ms": 1e3 * statistics.median(s[1] for s in splits),
                            "decode_ms": 1e3 * statistics.median(s[2] for s in splits),
                            "device_allocs": sum(s[3] for s in splits),
                            "tok_s": args.requests * args.max_tokens / statistics.median(walls), "walls": walls,
                            "hit_rate": hits / queries if queries else 0.0, "outputs": outputs[c]})
        print(f"done shared={shared}", file=sys.stderr, flush=True)
    print(f"\n{args.requests} requests x ({args.prefix} shared + {args.suffix}) tokens, {args.max_tokens} generated; "
          f"model {args.size}, {args.dtype} on {args.device}, block {args.block_size}; "
          f"medians of {args.repeats} rounds")
    print("| prefix | backend | caching | mamba_cache_mode | hit rate | TTFT (ms) | tok/s | tok/s vs off | "
          "vs none (paired) | prefill steps | prefill / decode ms | cudaMalloc | same tokens |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in records:
        base, none = twin(records, r, "off", "none"), twin(records, r, "on", "none")
        paired = statistics.median(n / w for n, w in zip(none["walls"], r["walls"], strict=True))
        same = r["outputs"] == base["outputs"]
        print(f"| {'shared' if r['shared'] else 'unique'} | {r['backend']} | {r['caching']} | {r['mode']} | "
              f"{r['hit_rate']:.0%} | {r['ttft_mean_ms']:.1f} | {r['tok_s']:.0f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}x | {paired:.3f}x | {r['prefill_steps']:.0f} | "
              f"{r['prefill_ms']:.0f} / {r['decode_ms']:.0f} | {r['device_allocs']} | {'yes' if same else 'NO'} |")
    if args.out:
        args.out.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in records], indent=2))


if __name__ == "__main__":
    main()
