"""Decode throughput with speculative decoding: no spec vs native spec (baseline backend, one
state per draft position) vs ReplaySSM spec (checkpoint + ring, rollback by cursor), k drafts per
step, at a fixed per-token acceptance set by the test proposer (`OracleProposer`: the target's own
greedy continuation, each position corrupted with probability 1 - acceptance).

Throughput is generated tokens over the wall time of one `generate` of `batch` requests (after a
warm-up of the same shape); every configuration must produce the greedy tokens of no-spec.

    python benchmarks/bench_spec_decode.py [--device cuda] [--size medium] [--batch 1 8 32] [--k 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import LAYERS, SIZES  # noqa: E402

from replayserve import LLM, SamplingParams  # noqa: E402
from replayserve.speculative.proposers import OracleProposer  # noqa: E402
from replayserve.tiny import make_tiny  # noqa: E402


def run(model_dir: Path, args: argparse.Namespace, batch: int, backend: str, spec: dict | None,
        prompts: list[list[int]]) -> tuple[float, list[list[int]], dict]:
    llm = LLM(str(model_dir), dtype=args.dtype, device=args.device, max_num_seqs=batch, ssm_backend=backend,
              max_num_batched_tokens=max(2048, batch * (1 + args.k)), replay_window=args.window,
              max_model_len=args.prompt + args.max_tokens + args.k + 8, speculative=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    reqs = [{"prompt_token_ids": p} for p in prompts]
    llm.generate(reqs, params, use_tqdm=False)  # warm-up: kernels compiled, allocator primed
    before = llm.get_metrics()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    sync()
    t0 = time.perf_counter()
    outs = llm.generate(reqs, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.get_metrics()
    delta = {k: after[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens", "num_steps")}
    return batch * args.max_tokens / wall, [o.token_ids for o in outs], delta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.9])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int, default=16)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    model_dir = make_tiny(tempfile.mkdtemp(), seed=0, layers=LAYERS[args.size], **SIZES[args.size])
    records = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, 500, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
        for backend in ("baseline", "replay"):
            tok_s, ref, _ = run(model_dir, args, batch, backend, None, prompts)
            records.append({"batch": batch, "config": f"no spec ({backend})", "acceptance": None, "tok_s": tok_s,
                            "same": True})
            paths = {tuple(p): o for p, o in zip(prompts, ref, strict=True)}
            for acc in args.acceptance:
                proposer = OracleProposer(paths, corrupt_prob=1.0 - acc, vocab_size=512, seed=1)
                spec = {"method": "custom", "num_speculative_tokens": args.k, "proposer": proposer}
                tok_s, outs, m = run(model_dir, args, batch, backend, spec, prompts)
                name = "native spec (baseline)" if backend == "baseline" else "ReplaySSM spec (replay)"
                rate = m["spec_num_accepted_tokens"] / max(1, m["spec_num_draft_tokens"])
                records.append({"batch": batch, "config": name, "acceptance": acc, "tok_s": tok_s,
                                "measured_acceptance": rate, "same": outs == ref,
                                "tokens_per_step": batch * args.max_tokens / m["num_steps"]})
            print(f"done batch {batch} {backend}", file=sys.stderr, flush=True)
            if args.out:  # after every batch, so a run cut short keeps what it measured
                args.out.write_text(json.dumps(records, indent=2))
    print(f"\nk = {args.k}, {args.prompt}-token prompts, {args.max_tokens} generated; model {args.size}, "
          f"{args.dtype} on {args.device}")
    print("| batch | config | acceptance (set / measured) | tok/s | vs no spec (baseline) | same tokens |")
    print("|---:|---|---|---:|---:|---|")
    for r in records:
        base = next(b["tok_s"] for b in records if b["batch"] == r["batch"] and b["config"] == "no spec (baseline)")
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1f} / {r['measured_acceptance']:.2f}"
        print(f"| {r['batch']} | {r['config']} | {acc} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | "
              f"{'yes' if r['same'] else 'NO'} |")


if __name__ == "__main__":
    main()
