"""`replayserve demo`: the built-in model's Python continuations of a few prompts, then greedy decode
speed without speculation and with n-gram and MTP drafts, with the acceptance the engine measured.

It prints as it goes (a line per timed run, the continuations once the first configuration has
run), then a table of medians with their range over the runs, and a sentence per drafting row
saying whether it was faster, slower or within the noise, and why."""

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
# Warm-up: every prompt, a few tokens, so the timed runs meet no first-use cost of the batch's shapes.
WARMUP_TOKENS = 8


@dataclass
class SpecRun:
    """One configuration's greedy runs over the demo prompts."""

    name: str
    rates: list[float]  # tok/s of each timed run
    acceptance: float | None  # accepted / proposed drafts; None without speculation
    tokens_per_step: float  # over all rows of a step
    token_ids: list[list[int]]
    device: str

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> str:
        return f"{min(self.rates):.0f}-{max(self.rates):.0f}"


def say(line: str = "") -> None:
    """A line out now, also when stdout is a pipe (the demo runs for tens of seconds)."""
    print(line, flush=True)


def measure(model: str, name: str, speculative: dict | None, max_tokens: int, repeats: int,
            engine: dict[str, Any], first: bool) -> tuple[SpecRun, list[str]]:
    """Greedy generation for every demo prompt at once, timed `repeats` times after a warm-up, a
    line per run; acceptance and tokens per step come from the engine's counters over the timed
    runs. `first`: also say where it runs. Returns the run and the last run's texts."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    # Closed before the next configuration's: a tensor-parallel LLM's workers hold the process group.
    with LLM(model=model, **{**engine, "speculative": speculative, "max_num_seqs": len(DEMO_PROMPTS)}) as llm:
        if first:
            say(f"running on {_where(llm)}")
        llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
        say(f"[{name}] loaded and warmed up in {time.perf_counter() - start:.1f} s")
        before = llm.get_metrics()
        rates = []
        for i in range(repeats):
            start = time.perf_counter()
            outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed)
            say(f"[{name}] run {i + 1}/{repeats}: {rates[-1]:.0f} tok/s ({elapsed:.1f} s)")
        after = llm.get_metrics()
    delta = {k: after[k] - before[k] for k in ("spec_num_draft_tokens", "spec_num_accepted_tokens", "num_steps",
                                               "num_generated_tokens")}
    acceptance = None
    if speculative is not None:
        acceptance = delta["spec_num_accepted_tokens"] / max(1, delta["spec_num_draft_tokens"])
    run = SpecRun(name, rates, acceptance, delta["num_generated_tokens"] / delta["num_steps"],
                  [list(o.outputs[0].token_ids) for o in outputs], llm.config.device)
    say(f"[{name}] median {run.median:.0f} tok/s, range {run.spread} over {repeats} run(s)")
    return run, [o.outputs[0].text for o in outputs]


def run_demo(model: str, max_tokens: int, repeats: int, num_drafts: int, engine: dict[str, Any]) -> None:
    """Prints the runs as they go, the continuations, the table and a verdict per drafting row.
    `engine`: LLM options; its `speculative`, when given, replaces the n-gram and MTP rows."""
    custom = engine.pop("speculative", None)
    configs: list[tuple[str, dict | None]] = [("none", None)]
    if custom is not None:
        configs.append((custom.get("method", "custom"), custom))
    else:
        configs.append(("n-gram", {"method": "ngram", "num_speculative_tokens": num_drafts}))
        configs.append(("MTP", {"method": "mtp", "num_speculative_tokens": num_drafts}))
    configs = [(n, s) for n, s in configs if s is None or s.get("method") != "mtp" or _has_mtp(model)]
    say(f"greedy decode of {len(DEMO_PROMPTS)} prompts x {max_tokens} tokens with drafts "
        f"{', '.join(n for n, _ in configs)}; each: a warm-up, then {repeats} timed run(s), the median counts")
    runs: list[tuple[SpecRun, dict | None]] = []
    for name, spec in configs:
        run, texts = measure(model, name, spec, max_tokens, repeats, engine, first=not runs)
        if not runs:
            _print_continuations(texts)
        runs.append((run, spec))
    base = runs[0][0]
    on_cpu = base.device.startswith("cpu")
    say()
    say(f"greedy decode of {len(DEMO_PROMPTS)} prompts x {max_tokens} tokens, median and range of {repeats} "
        "timed run(s):")
    say("| drafts | tok/s (median) | range | speed-up | acceptance | tokens/step | same tokens as none |")
    say("|---|---:|---:|---:|---:|---:|---|")
    for r, _ in runs:
        acc = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
        same = sum(a == b for a, b in zip(r.token_ids, base.token_ids, strict=True))
        say(f"| {r.name} | {r.median:.0f} | {r.spread} | {r.median / base.median:.2f}x | {acc} | "
            f"{r.tokens_per_step:.2f} | {same}/{len(base.token_ids)} |")
    for r, spec in runs[1:]:
        assert spec is not None
        say(verdict(r, base, spec["num_speculative_tokens"], on_cpu))
    if on_cpu:
        say("CPU figures are noisy: other processes and the OS scheduler move them by tens of percent from run to "
            "run (the range column shows this run's); --repeats R takes more runs.")


def verdict(run: SpecRun, base: SpecRun, num_drafts: int, on_cpu: bool) -> str:
    """One sentence on a drafting row against no drafts: faster, slower, or within the noise
    (the runs' ranges overlap), with the step time and tokens per step behind it."""
    speedup = run.median / base.median
    # Seconds per step relative to no drafts: (tokens / step) / (tokens / s).
    step_time = (run.tokens_per_step / run.median) / (base.tokens_per_step / base.median)
    advance = run.tokens_per_step / base.tokens_per_step
    why = (f"a step took {step_time:.1f}x as long as without drafts (it proposes up to {num_drafts} drafts per row "
           f"and verifies them with the row's token) and advanced {advance:.2f}x as many tokens")
    if min(run.rates) <= max(base.rates) and min(base.rates) <= max(run.rates):
        return f"{run.name}: {speedup:.2f}x, within the range of the runs without drafts: no clear difference here."
    if speedup < 1:
        cpu = " A step's time on a CPU grows with the tokens it runs, so drafts pay only when most are accepted."
        return (f"{run.name}: {speedup:.2f}x: slower than no drafts; drafts cost more than they save here: {why}."
                + (cpu if on_cpu else ""))
    return f"{run.name}: {speedup:.2f}x faster than no drafts: {why}."


def _where(llm: LLM) -> str:
    where = f"{llm.config.device} ({llm.config.dtype})"
    if llm.cpu_threads is not None:
        count = llm.cpu_threads.count
        where += f", {count} CPU thread{'' if count == 1 else 's'}: {llm.cpu_threads.why}; --threads N sets it"
    return where


def _has_mtp(model: str) -> bool:
    from replayserve.config import ModelConfig
    from replayserve.tiny_code import resolve_model

    return ModelConfig.from_dir(resolve_model(model)).num_nextn_predict_layers > 0


def _print_continuations(texts: list[str]) -> None:
    for i, (prompt, text) in enumerate(zip(DEMO_PROMPTS, texts, strict=True)):
        say(f"{'-' * 30} prompt {i + 1}/{len(DEMO_PROMPTS)} {'-' * 30}")
        say(prompt + text)
    say("-" * 72)
