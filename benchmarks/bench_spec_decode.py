"""Decode throughput with speculative decoding, in two modes.

Synthetic (default): no spec vs native spec (baseline backend, one state per draft position) vs
ReplaySSM spec (checkpoint + ring, rollback by cursor), k drafts per step, at a fixed per-token
acceptance set by the test proposer (`OracleProposer`: the target's own greedy continuation, each
position corrupted with probability 1 - acceptance).

Real (`--model replayserve/tiny-code` or a model directory with MTP layers): the real proposers,
n-gram prompt lookup and the checkpoint's MTP layer, against no spec on both backends, on
held-out code: each prompt is the last `--prompt` tokens of a held-out stdlib file up to one of
its `def` headers (`heldout_sample.json` beside the weights). It reports the measured acceptance,
the share of verify rows that accepted the i-th draft (i = 1..k), and the speed-up.

The model is a random-weight one of a named shape built in memory (`shapes.random_model`, so the
Nemotron-H-8B shape needs no checkpoint), driven through `Engine.step()` with CUDA graphs where
the device has them, with `confident_` weights. Throughput is the tokens generated after every
request has its first one over that decode phase's wall time (after a warm-up of the same shape;
prefill is not counted). Every configuration must produce the greedy tokens of no-spec (the last
column: the share of rows whose tokens equal no-spec's; a float tie can flip one).

    python benchmarks/bench_spec_decode.py [--device cuda] [--size nemotron-h-8b] [--batch 1 8 32] [--k 3]
    python benchmarks/bench_spec_decode.py --model replayserve/tiny-code [--device cuda] [--batch 1 8 32] [--k 3]
        [--mtp-window 256 64]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SIZES, model_config, random_model  # noqa: E402

from replayserve.builtin.tiny_code import heldout_texts, resolve_model  # noqa: E402
from replayserve.config import ConfigError, EngineConfig, SpeculativeConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.llm import LLM  # noqa: E402
from replayserve.models.nemotron_h import NemotronHForCausalLM  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402
from replayserve.speculative.proposers import OracleProposer  # noqa: E402
from replayserve.tokenizer import Tokenizer  # noqa: E402

_HEADER_LINE = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]+\w+.*:[ \t]*$", re.MULTILINE)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def serve(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int, int]:
    """Serves the prompts; returns the outputs and the decode phase's wall seconds, tokens and
    steps (from the step after which every request has its first token)."""
    sync = torch.cuda.synchronize if engine.runner.device.type == "cuda" else (lambda: None)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = [engine.add_request(p, params) for p in prompts]
    while not all(r.output_token_ids for r in requests):
        engine.step()
    sync()
    t0, before, steps = time.perf_counter(), sum(len(r.output_token_ids) for r in requests), engine.num_steps
    while engine.has_unfinished():
        engine.step()
    sync()
    wall = time.perf_counter() - t0
    tokens = sum(len(r.output_token_ids) for r in requests) - before
    return [list(r.output_token_ids) for r in requests], wall, tokens, engine.num_steps - steps


def confident_(model: NemotronHForCausalLM) -> NemotronHForCausalLM:
    """Random weights whose greedy path no rounding can flip: the LM head is the embedding and
    every block's output projection is scaled down, so the residual stream stays close to the
    current token's embedding and its logit leads the others by ~sqrt(hidden) standard deviations
    (random weights leave near-ties that bf16 rounding, which depends on the batch shape, flips
    within a few tokens; the oracle then has nothing to propose). The work of a step does not
    depend on the weights' values, so speed is unchanged."""
    with torch.no_grad():
        model.lm_head.weight.copy_(model.backbone.embeddings.weight)
        for name, param in model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "down_proj.weight")):
                param.mul_(0.05)
    return model


def release(device: str) -> None:
    """Frees what a dropped engine held: its graphs' memory pools go with its reference cycles."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def measure(make_engine: Callable[[], Engine], prompts: list[list[int]], max_tokens: int,
            device: str) -> tuple[float, list[list[int]], dict]:
    """A warm-up serve (kernels compiled, graphs captured), then a timed one: its decode tok/s,
    outputs and counters (drafts, accepted drafts, per position, decode steps and tokens). The
    engine is built here and freed before this returns."""
    engine = make_engine()
    try:
        serve(engine, prompts, max_tokens)
        before = engine.get_metrics()
        outs, wall, tokens, steps = serve(engine, prompts, max_tokens)
        after = engine.get_metrics()
    finally:
        del engine
        release(device)
    delta = {k: after[k] - before[k] for k in ("spec_num_drafts", "spec_num_draft_tokens",
                                               "spec_num_accepted_tokens")}
    per_position = [a - b for a, b in itertools.zip_longest(after["spec_accepted_per_position"],
                                                            before["spec_accepted_per_position"], fillvalue=0)]
    return tokens / wall, outs, delta | {"decode_steps": steps, "decode_tokens": tokens,
                                         "accepted_per_position": per_position}


def run(model: NemotronHForCausalLM, args: argparse.Namespace, batch: int, backend: str, spec: dict | None,
        prompts: list[list[int]]) -> tuple[float, list[list[int]], dict]:
    config = EngineConfig(model=model.config, dtype=args.dtype, device=args.device, max_num_seqs=batch,
                          ssm_backend=backend, max_num_batched_tokens=max(2048, batch * (1 + args.k)),
                          replay_window=args.window, max_model_len=args.prompt + args.max_tokens + args.k + 8,
                          speculative=None if spec is None else SpeculativeConfig(**spec))
    return measure(lambda: Engine(config, model, tokenizer=None), prompts, args.max_tokens, args.device)


def heldout_prompts(tokenizer: Tokenizer, texts: list[str], count: int, length: int) -> list[list[int]]:
    """`count` prompts, each the last `length` tokens of a held-out text up to the end of one of its
    `def` lines, taken round-robin over the texts (each text's headers in order)."""
    per_text = [[text[: m.end() + 1] for m in _HEADER_LINE.finditer(text)] for text in texts]
    prompts: list[list[int]] = []
    for i in itertools.count():
        row = [heads[i] for heads in per_text if i < len(heads)]
        if not row:
            raise ValueError(f"the held-out sample has only {len(prompts)} def headers; {count} prompts were asked for")
        for prefix in row:
            prompts.append(tokenizer.encode(prefix, add_special_tokens=False)[-length:])
            if len(prompts) == count:
                return prompts
    raise AssertionError("unreachable")


def real_proposers(args: argparse.Namespace) -> list[dict]:
    """No spec, n-gram and MTP drafts on held-out code, per batch and backend."""
    model_dir = resolve_model(args.model)
    texts = heldout_texts(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer is not None
    specs = [("no spec", None), ("n-gram", {"method": "ngram", "num_speculative_tokens": args.k})]
    specs += [("MTP" if len(args.mtp_window) == 1 else f"MTP w{w}",
               {"method": "mtp", "num_speculative_tokens": args.k, "mtp_window": w}) for w in args.mtp_window]
    records = []
    for batch in args.batch:
        prompts = heldout_prompts(tokenizer, texts, batch, args.prompt)
        for backend in ("baseline", "replay"):
            ref: list[list[int]] = []
            for name, spec in specs:
                options = {"dtype": args.dtype, "device": args.device, "max_num_seqs": batch, "ssm_backend": backend,
                           "replay_window": args.window, "speculative": spec,
                           "max_num_batched_tokens": max(2048, batch * (1 + args.k)),
                           "max_model_len": args.prompt + args.max_tokens + args.k + 8}
                tok_s, outs, m = measure(lambda o=options: LLM(model=model_dir, **o).engine, prompts, args.max_tokens,
                                         args.device)
                ref = ref or outs
                drafts = max(1, m["spec_num_drafts"])
                records.append({"batch": batch, "backend": backend, "config": name, "tok_s": tok_s,
                                "acceptance": None if spec is None else
                                m["spec_num_accepted_tokens"] / max(1, m["spec_num_draft_tokens"]),
                                "accepted_per_position": [a / drafts for a in m["accepted_per_position"]],
                                "tokens_per_step": m["decode_tokens"] / m["decode_steps"],
                                "same_rows": sum(a == b for a, b in zip(outs, ref, strict=True)) / batch})
            print(f"done batch {batch} {backend}", file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(json.dumps(records, indent=2))
    print(f"\nk = {args.k}, {args.prompt}-token held-out prompts, {args.max_tokens} generated greedily; "
          f"{args.model}, {args.dtype} on {args.device}")
    print("| batch | backend | drafts | tok/s | vs no spec (baseline) | acceptance | accepted at position 1..k | "
          "tokens/step | rows equal to no spec |")
    print("|---:|---|---|---:|---:|---:|---|---:|---:|")
    for r in records:
        base = next(b["tok_s"] for b in records if b["batch"] == r["batch"] and b["config"] == "no spec"
                    and b["backend"] == "baseline")
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        positions = " / ".join(f"{p:.2f}" for p in r["accepted_per_position"]) or "-"
        print(f"| {r['batch']} | {r['backend']} | {r['config']} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | "
              f"{acc} | {positions} | {r['tokens_per_step']:.1f} | {r['same_rows']:.0%} |")
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--model", help="real proposers on this model (replayserve/tiny-code or a directory)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.6, 0.9])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=int,
                        help="replay_window (default: the engine's, 32 without and 16 with speculation)")
    parser.add_argument("--mtp-window", type=int, nargs="+", default=[256],
                        help="--model: the MTP attention's window of recorded positions; a row for each")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if args.model:
        real_proposers(args)
        return
    model = confident_(random_model(model_config(args.size), DTYPES[args.dtype], args.device, seed=0))
    vocab = model.config.vocab_size
    records = []
    for batch in args.batch:
        gen = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(3, vocab, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
        for backend in ("baseline", "replay"):
            tok_s, ref, m = run(model, args, batch, backend, None, prompts)
            records.append({"batch": batch, "config": f"no spec ({backend})", "acceptance": None, "tok_s": tok_s,
                            "same_rows": 1.0, "tokens_per_step": m["decode_tokens"] / m["decode_steps"]})
            paths = {tuple(p): o for p, o in zip(prompts, ref, strict=True)}
            for acc in args.acceptance:
                proposer = OracleProposer(paths, corrupt_prob=1.0 - acc, vocab_size=vocab, seed=1)
                spec = {"method": "custom", "num_speculative_tokens": args.k, "proposer": proposer}
                name = "native spec (baseline)" if backend == "baseline" else "ReplaySSM spec (replay)"
                try:
                    tok_s, outs, m = run(model, args, batch, backend, spec, prompts)
                except (ConfigError, torch.OutOfMemoryError) as e:  # native spec keeps 1 + k states a row
                    records.append({"batch": batch, "config": name, "acceptance": acc,
                                    "skipped": str(e).split(";")[0][:160]})
                    tok_s = None
                if tok_s is None:
                    # The half-built engine lived in the exception's frames, gone only now: free its
                    # memory, or every later row is refused for want of it (seen on an H100).
                    release(args.device)
                    continue
                rate = m["spec_num_accepted_tokens"] / max(1, m["spec_num_draft_tokens"])
                records.append({"batch": batch, "config": name, "acceptance": acc, "tok_s": tok_s,
                                "measured_acceptance": rate,
                                "same_rows": sum(a == b for a, b in zip(outs, ref, strict=True)) / batch,
                                "tokens_per_step": m["decode_tokens"] / m["decode_steps"]})
            print(f"done batch {batch} {backend}", file=sys.stderr, flush=True)
            if args.out:  # after every batch, so a run cut short keeps what it measured
                args.out.write_text(json.dumps(records, indent=2))
    print(f"\nk = {args.k}, {args.prompt}-token prompts, {args.max_tokens} generated; model {args.size}, "
          f"{args.dtype} on {args.device}")
    print("| batch | config | acceptance (set / measured) | tok/s | vs no spec (baseline) | tokens/step | "
          "rows equal to no spec |")
    print("|---:|---|---|---:|---:|---:|---:|")
    for r in records:
        if "skipped" in r:
            print(f"| {r['batch']} | {r['config']} | {r['acceptance']:.1f} | skipped: {r['skipped']} | | | |")
            continue
        base = next(b["tok_s"] for b in records if b["batch"] == r["batch"] and b["config"] == "no spec (baseline)")
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.1f} / {r['measured_acceptance']:.2f}"
        print(f"| {r['batch']} | {r['config']} | {acc} | {r['tok_s']:.0f} | {r['tok_s'] / base:.2f}x | "
              f"{r['tokens_per_step']:.1f} | {r['same_rows']:.0%} |")


if __name__ == "__main__":
    main()
