"""`replayserve demo | generate | make-tiny`."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

DEMO_PROMPTS = [
    "Hybrid language models mix",
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time there was",
    "Serving such a model means",
    "Numbers: 0 1 2",
    "A Mamba2 layer keeps",
    "Questions? Answers!",
]


def default_demo_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "replayserve" / "tiny-nemotron-h"


def _demo(args: argparse.Namespace) -> None:
    from replayserve import LLM, SamplingParams
    from replayserve.tiny import make_tiny

    model_dir = Path(args.model_dir or default_demo_dir())
    if not (model_dir / "config.json").is_file():
        print(f"writing a tiny random Nemotron-H to {model_dir}")
        make_tiny(model_dir, seed=0)
    llm = LLM(model=str(model_dir), dtype=args.dtype, device=args.device)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(DEMO_PROMPTS, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(DEMO_PROMPTS, outputs, strict=True):
        print(f"{prompt!r} -> {out.text!r}")
    n = sum(len(o.token_ids) for o in outputs)
    print(f"throughput: {n} tokens in {elapsed:.2f} s = {n / elapsed:.1f} tok/s "
          f"(batch {len(outputs)}, {llm.config.dtype}, {llm.config.device})")


def _generate(args: argparse.Namespace) -> None:
    from replayserve import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, device=args.device)
    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop or (),
    )
    for prompt, out in zip(args.prompt, llm.generate(args.prompt, params), strict=True):
        print(f"{prompt}{out.text}")


def _make_tiny(args: argparse.Namespace) -> None:
    from replayserve.tiny import make_tiny

    out = make_tiny(args.dir, seed=args.seed, layers=args.layers)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="replayserve")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="generate with a tiny built-in model")
    demo.add_argument("--model-dir", help=f"where the tiny model lives (default {default_demo_dir()})")
    demo.add_argument("--max-tokens", type=int, default=32)
    gen = sub.add_parser("generate", help="generate from a model directory")
    gen.add_argument("--model", required=True)
    gen.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append")
    for p in (demo, gen):
        p.add_argument("--dtype", default="auto")
        p.add_argument("--device")
    tiny = sub.add_parser("make-tiny", help="write a random tiny Nemotron-H in Hugging Face format")
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--layers", default="M*-ME", help="layer pattern: M Mamba2, * attention, - MLP, E MoE")
    args = parser.parse_args(argv)
    {"demo": _demo, "generate": _generate, "make-tiny": _make_tiny}[args.command](args)


if __name__ == "__main__":
    main()
