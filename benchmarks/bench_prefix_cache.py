"""Shared-prefix serving workload: time to first token and throughput with prefix caching off vs
``mamba_cache_mode`` none / align / all, on both SSM backends; plus a workload with no shared
prefix, where caching can only cost (bookkeeping, boundary-state copies).

A wave of ``--requests`` prompts (one ``--prefix``-token system prompt + a ``--suffix``-token
question each) arrives at once after one warm-up request has served the system prompt. TTFT is
measured per request from the wave's arrival to its first sampled token; throughput is generated
tokens over the wave's wall time; both are medians over ``--repeats`` waves. Every configuration
is checked to produce the same greedy tokens as caching off. The model is a random Nemotron-H
built locally (`--size tiny|medium`).

    python benchmarks/bench_prefix_cache.py [--device cuda] [--size medium] [--requests 32] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from replayserve import LLM, SamplingParams  # noqa: E402
from replayserve.tiny import make_tiny  # noqa: E402

SIZES = {
    "tiny": {},
    # A few hundred million parameters: Nemotron-H-like layer mix, 8B-like Mamba head geometry.
    "medium": {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
               "intermediate_size": 2048, "mamba_num_heads": 32, "mamba_head_dim": 64, "ssm_state_size": 128,
               "n_groups": 8, "chunk_size": 128, "moe_intermediate_size": 512,
               "moe_shared_expert_intermediate_size": 512, "max_position_embeddings": 8192},
}
LAYERS = {"tiny": "M*-ME", "medium": "M-M*-M-M*-ME"}
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


def run_wave(llm: LLM, wave: list[list[int]], max_tokens: int) -> tuple[list[float], float, list[list[int]]]:
    """TTFTs (s), wall time (s) and outputs of one wave submitted at once."""
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if llm.config.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    requests = [engine.add_request(p, params) for p in wave]
    first: dict[str, float] = {}
    while engine.has_unfinished():
        engine.step()  # sampled tokens reach the host each step, so the clock needs no extra sync
        now = time.perf_counter()
        for r in requests:
            if r.output_token_ids and r.request_id not in first:
                first[r.request_id] = now - t0
    wall = time.perf_counter() - t0
    return [first[r.request_id] for r in requests], wall, [r.output_token_ids for r in requests]


def measure(model_dir: Path, args: argparse.Namespace, backend: str, caching: str, mode: str,
            shared: bool) -> dict[str, float | str]:
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, max_num_seqs=args.requests,
              max_num_batched_tokens=args.budget, block_size=args.block_size,
              max_model_len=args.prefix + args.suffix + args.max_tokens + 16, ssm_backend=backend,
              enable_prefix_caching=caching == "on", mamba_cache_mode=mode,
              num_mamba_cache_slots=4 * args.requests if mode != "none" else None)
    vocab = llm.config.model.vocab_size
    warm = prompts(1, args.prefix, args.suffix, True, vocab, seed=1)
    run_wave(llm, warm, 2)  # compiles kernels, and serves the system prompt once
    ttfts, walls, outs = [], [], []
    for rep in range(args.repeats):  # fresh questions (and fresh heads when unshared) each wave
        wave = prompts(args.requests, args.prefix, args.suffix, shared, vocab, seed=2 + rep)
        ttft, wall, wave_outs = run_wave(llm, wave, args.max_tokens)
        ttfts.append(statistics.mean(ttft))
        walls.append(wall)
        outs += wave_outs
    ttft_mean, wall = statistics.median(ttfts), statistics.median(walls)
    m = llm.get_metrics()
    hits = m["prefix_cache_hits"] / m["prefix_cache_queries"] if m["prefix_cache_queries"] else 0.0
    return {"backend": backend, "caching": caching, "mode": mode, "shared": shared,
            "ttft_mean_ms": 1e3 * ttft_mean, "tok_s": args.requests * args.max_tokens / wall, "wall_s": wall,
            "hit_rate": hits, "outputs": outs}


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
    parser.add_argument("--repeats", type=int, default=3, help="waves per configuration; medians are reported")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model_dir = make_tiny(tempfile.mkdtemp(), seed=0, layers=LAYERS[args.size], **SIZES[args.size])
    measure(model_dir, args, args.backends[0], "off", "none", True)  # warms the process up; not reported
    records = []
    for shared in (True, False):
        for backend in args.backends:
            for caching, mode in CONFIGS:
                records.append(measure(model_dir, args, backend, caching, mode, shared))
                print(f"done {backend} caching={caching} mode={mode} shared={shared}", file=sys.stderr, flush=True)
    print(f"\n{args.requests} requests x ({args.prefix} shared + {args.suffix}) tokens, {args.max_tokens} generated; "
          f"model {args.size}, {args.dtype} on {args.device}, block {args.block_size}")
    print("| prefix | backend | caching | mamba_cache_mode | hit rate | TTFT mean (ms) | tok/s | tok/s vs off | "
          "same tokens |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for r in records:
        base = next(b for b in records
                    if (b["backend"], b["shared"], b["caching"]) == (r["backend"], r["shared"], "off"))
        same = r["outputs"] == base["outputs"]
        print(f"| {'shared' if r['shared'] else 'unique'} | {r['backend']} | {r['caching']} | {r['mode']} | "
              f"{r['hit_rate']:.0%} | {r['ttft_mean_ms']:.1f} | {r['tok_s']:.0f} | "
              f"{r['tok_s'] / base['tok_s']:.2f}x | {'yes' if same else 'NO'} |")
    if args.out:
        args.out.write_text(json.dumps([{k: v for k, v in r.items() if k != "outputs"} for r in records], indent=2))


if __name__ == "__main__":
    main()
