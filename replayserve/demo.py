"""`replayserve demo`: the built-in model's Python continuations of a few prompts, then greedy decode
speed without speculation and with n-gram and MTP drafts, with the acceptance the engine measured."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from replayserve.engine.request import SamplingParams
from replayserve.llm import LLM

# No prompt ends in a newline: the tokenizer merges a newline with the next line's indentation, so
# the model writes them together (a bare newline token would announce an unindented line).
DEMO_PROMPTS = [
    "def fibonacci(n):",
    "class Stack:\n    def __init__(self):",
    'def read_lines(path):\n    """Return the lines of the file at *path*."""',
    "import os\n\n\ndef list_python_files(directory):",
    "    def __repr__(self):",
    "def is_prime(n):",
]


@dataclass
class SpecRun:
    """One configuration's greedy run over the demo prompts."""

    name: str
    tok_s: float
    acceptance: float | None  # accepted / proposed drafts; None without speculation
    tokens_per_step: float
    token_ids: list[list[int]]
    where: str  # dtype and device


def measure(model: str, name: str, speculative: dict | None, max_tokens: int, repeats: int,
            engine: dict[str, Any]) -> tuple[SpecRun, list[str]]:
    """Greedy generation for every demo prompt at once, timed `repeats` times after a warm-up (the
    median rate counts); acceptance and tokens per step come from the engine's counters over the
    timed runs. Returns the run and the texts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Closed before the next configuration's: a tensor-parallel LLM's workers hold the process group.
    with LLM(model=model, **{**engine, "speculative": speculative, "max_num_seqs": len(DEMO_PROMPTS)}) as llm:
        llm.generate(DEMO_PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm-up
        before = llm.get_metrics()
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
        after = llm.get_metrics()
    delta = {k: after[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens", "num_steps",
                                               "num_generated_tokens")}
    acceptance = None
    if speculative is not None:
        acceptance = delta["spec_num_accepted_tokens"] / max(1, delta["spec_num_draft_tokens"])
    run = SpecRun(name, statistics.median(rates), acceptance, delta["num_generated_tokens"] / delta["num_steps"],
                  [list(o.outputs[0].token_ids) for o in outputs], f"{llm.config.dtype}, {llm.config.device}")
    return run, [o.outputs[0].text for o in outputs]


def run_demo(model: str, max_tokens: int, repeats: int, num_drafts: int, engine: dict[str, Any]) -> None:
    """Prints the continuations and the table. `engine`: LLM options; its `speculative`, when
    given, replaces the n-gram and MTP rows."""
    custom = engine.pop("speculative", None)
    configs: list[tuple[str, dict | None]] = [("none", None)]
    if custom is not None:
        configs.append((custom.get("method", "custom"), custom))
    else:
        configs.append(("n-gram", {"method": "ngram", "num_speculative_tokens": num_drafts}))
        configs.append(("MTP", {"method": "mtp", "num_speculative_tokens": num_drafts}))
    runs = []
    for name, spec in configs:
        if spec is not None and spec.get("method") == "mtp" and not _has_mtp(model):
            continue
        run, texts = measure(model, name, spec, max_tokens, repeats, engine)
        if not runs:
            _print_continuations(texts)
        runs.append(run)
    base = runs[0]
    print(f"greedy decode of {len(DEMO_PROMPTS)} prompts x {max_tokens} tokens, median of {repeats} timed "
          f"run(s), {base.where}:")
    print("| drafts | tok/s | speed-up | acceptance | tokens/step | same tokens as none |")
    print("|---|---:|---:|---:|---:|---|")
    for r in runs:
        acc = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
        same = sum(a == b for a, b in zip(r.token_ids, base.token_ids, strict=True))
        print(f"| {r.name} | {r.tok_s:.0f} | {r.tok_s / base.tok_s:.2f}x | {acc} | {r.tokens_per_step:.2f} | "
              f"{same}/{len(base.token_ids)} |")


def _has_mtp(model: str) -> bool:
    from replayserve.config import ModelConfig
    from replayserve.tiny_code import resolve_model

    return ModelConfig.from_dir(resolve_model(model)).num_nextn_predict_layers > 0


def _print_continuations(texts: list[str]) -> None:
    for prompt, text in zip(DEMO_PROMPTS, texts, strict=True):
        print("-" * 72)
        print(prompt + text)
    print("-" * 72)
