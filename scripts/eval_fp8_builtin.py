"""Accuracy of the built-in model with FP8 weights, an FP8 KV cache and both, against itself in
16/32-bit, with the checks its training recorded (``builtin/tiny_code.py``): held-out perplexity
(``eval.json``'s files and window) and greedy agreement over 64 held-out ``def`` headers.

    python scripts/eval_fp8_builtin.py [--device cuda] [--dtype bfloat16] [--fp8-dir DIR]

Without ``--fp8-dir`` it writes ``replayserve quantize replayserve/tiny-code`` to a temporary
directory first. On the CPU the FP8 Linears run the reference (FP8 weights, activations unrounded:
the tool writes no static activation scales); on CUDA prefill rows go through ``torch._scaled_mm``
with per-call activation scales, so the two devices measure different arithmetic.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
from pathlib import Path

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny_code import (
    eval_results,
    function_headers,
    heldout_perplexity,
    heldout_texts,
    perplexity_windows,
)
from replayserve.config.builtin_models import TINY_CODE_DIR
from replayserve.quantize import quantize_checkpoint

PROMPTS, MAX_TOKENS = 64, 32


def measure(model_dir: Path, device: str, dtype: str, kv_cache_dtype: str = "auto") -> tuple[float, list[list[int]]]:
    """(held-out perplexity, greedy tokens of each held-out header) of one checkpoint."""
    texts, recorded = heldout_texts(TINY_CODE_DIR), eval_results(TINY_CODE_DIR)["heldout_perplexity"]
    llm = LLM(str(model_dir), device=device, dtype=dtype, kv_cache_dtype=kv_cache_dtype, warmup=False)
    windows = perplexity_windows(llm, texts, recorded["files"], recorded["tokens_per_file"])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    outs = llm.generate(function_headers(texts, PROMPTS), params, use_tqdm=False)
    return heldout_perplexity(llm, windows), [list(o.outputs[0].token_ids) for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", default="float32", help="the model dtype of both runs (default %(default)s)")
    p.add_argument("--fp8-dir", type=Path, help="an FP8 checkpoint of the built-in model (default: write one)")
    args = p.parse_args()
    logging.getLogger("replayserve").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory() as tmp:
        fp8_dir = args.fp8_dir or Path(tmp) / "fp8"
        if args.fp8_dir is None:
            quantize_checkpoint(TINY_CODE_DIR, fp8_dir)
        ppl, tokens = measure(TINY_CODE_DIR, args.device, args.dtype)
        print(f"device {args.device}, dtype {args.dtype}: held-out perplexity {ppl:.3f}")
        runs = (("FP8 weights", fp8_dir, "auto"), ("FP8 KV cache (scale 1.0)", TINY_CODE_DIR, "fp8"),
                ("FP8 weights + FP8 KV cache", fp8_dir, "fp8"))
        for label, model_dir, kv in runs:
            report(label, ppl, tokens, *measure(model_dir, args.device, args.dtype, kv))


def report(label: str, ppl: float, tokens: list[list[int]], ppl8: float, tokens8: list[list[int]]) -> None:
    pairs = list(zip(tokens, tokens8, strict=True))
    same_tokens = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True)) / (len(pairs) * MAX_TOKENS)
    print(f"{label}: perplexity {ppl8:.3f} ({100 * (ppl8 / ppl - 1):+.2f}%); greedy agreement over {len(pairs)} "
          f"held-out headers x {MAX_TOKENS} tokens: first token {sum(x[0] == y[0] for x, y in pairs) / len(pairs):.0%}"
          f", tokens {same_tokens:.0%}, whole completions {sum(x == y for x, y in pairs) / len(pairs):.0%}")

if __name__ == "__main__":
    main()
