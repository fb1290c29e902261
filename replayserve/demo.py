"""`replayserve demo`: the built-in model's Python continuations of a few prompts, then greedy decode
speed without speculation and with n-gram and MTP drafts, with the acceptance the engine measured.

The configurations are timed in rounds, each round running every configuration once, so a burst
of load from other processes falls on all rows alike and each speed-up compares runs made side by
side. (A tensor-parallel engine holds the process group, so with `tensor_parallel_size` > 1 the
configurations run one after another instead.) It prints as it goes: a line per timed run, the
continuations after the first round, then a table of medians with their range over the rounds
and a sentence per drafting row saying whether it was faster, slower (and why) or within the noise."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from replayserve.config import ModelConfig
from replayserve.config.builtin_models import resolve_model
from replayserve.llm import LLM
from replayserve.sampling_params import SamplingParams
from replayserve.structured import StructuredOutputsParams
from replayserve.structured.grammar import StructuredOutputError

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
# The structured-output example after the continuations: a description of a function as JSON.
JSON_PROMPT = "def fibonacci(n):"
JSON_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "arguments": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    "returns": {"type": "string", "enum": ["int", "str", "list", "bool", "None"]},
}, "required": ["name", "arguments", "returns"]}
# Warm-up: every prompt, a few tokens, so the timed runs meet no first-use cost of the batch's shapes.
WARMUP_TOKENS = 8
_COUNTERS = ("spec_num_draft_tokens", "spec_num_accepted_tokens", "num_steps", "num_generated_tokens")


@dataclass
class SpecRun:
    """One configuration's timed greedy runs over the demo prompts, one per round."""

    name: str
    speculative: dict | None
    rates: list[float] = field(default_factory=list)  # tok/s of each round
    token_ids: list[list[int]] = field(default_factory=list)  # of the last run
    texts: list[str] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)  # the engine's, over the timed runs
    device: str = "cpu"
    cpu_threads: int | None = None  # on the CPU: the engine's intra-op threads
    cpu_busy: list[float] = field(default_factory=list)  # this process's CPU seconds per second of each run

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    @property
    def spread(self) -> str:
        return f"{min(self.rates):.0f}-{max(self.rates):.0f}"

    @property
    def acceptance(self) -> float | None:
        """Accepted / proposed drafts; None without speculation."""
        if self.speculative is None:
            return None
        return self.counters["spec_num_accepted_tokens"] / max(1, self.counters["spec_num_draft_tokens"])

    @property
    def tokens_per_step(self) -> float:
        """Tokens a step advanced, over all rows."""
        return self.counters["num_generated_tokens"] / max(1, self.counters["num_steps"])

    def speedups(self, base: SpecRun) -> list[float]:
        """This row's rate over the base row's, round by round."""
        return [mine / theirs for mine, theirs in zip(self.rates, base.rates, strict=True)]

    def time_once(self, llm: LLM, params: SamplingParams) -> float:
        """One timed greedy run over every prompt at once; adds the engine counters it moved."""
        before = llm.get_metrics()
        start, cpu_start = time.perf_counter(), time.process_time()
        outputs = llm.generate(DEMO_PROMPTS, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        self.cpu_busy.append((time.process_time() - cpu_start) / elapsed)
        after = llm.get_metrics()
        for k in _COUNTERS:
            self.counters[k] = self.counters.get(k, 0) + after[k] - before[k]
        self.token_ids = [list(o.outputs[0].token_ids) for o in outputs]
        self.texts = [o.outputs[0].text for o in outputs]
        self.rates.append(sum(len(ids) for ids in self.token_ids) / elapsed)
        return self.rates[-1]


def say(line: str = "") -> None:
    """A line out now, also when stdout is a pipe (the demo runs for tens of seconds)."""
    print(line, flush=True)


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
    runs = [SpecRun(n, s) for n, s in configs if s is None or s.get("method") != "mtp" or _has_mtp(model)]
    side_by_side = engine.get("tensor_parallel_size", 1) == 1
    share = engine.get("gpu_memory_utilization", 0.9)
    if side_by_side and isinstance(share, float | int) and 0 < share <= 1:  # else LLM names the bad value
        engine = {**engine, "gpu_memory_utilization": share / len(runs)}  # the engines share the card
    say(f"greedy decode of {len(DEMO_PROMPTS)} prompts x {max_tokens} tokens with drafts "
        f"{', '.join(r.name for r in runs)}: a warm-up, then {repeats} timed round(s), "
        + ("each running every configuration once" if side_by_side else "one configuration after another"))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    if side_by_side:
        with contextlib.ExitStack() as stack:
            engines = [stack.enter_context(_engine(model, run, engine, first=run is runs[0])) for run in runs]
            for i in range(repeats):
                for run, llm in zip(runs, engines, strict=True):
                    _time_and_say(run, llm, params, i, repeats)
                if i == 0:
                    _print_continuations(runs[0].texts)
                    _print_json_answer(engines[0])
    else:
        for run in runs:  # closed before the next: a tensor-parallel LLM's workers hold the process group
            with _engine(model, run, engine, first=run is runs[0]) as llm:
                for i in range(repeats):
                    _time_and_say(run, llm, params, i, repeats)
                if run is runs[0]:
                    _print_continuations(runs[0].texts)
                    _print_json_answer(llm)
    _print_table(runs, max_tokens, repeats)


def _time_and_say(run: SpecRun, llm: LLM, params: SamplingParams, index: int, repeats: int) -> None:
    rate = run.time_once(llm, params)
    say(f"[{run.name}] run {index + 1}/{repeats}: {rate:.0f} tok/s")


@contextlib.contextmanager
def _engine(model: str, run: SpecRun, engine: dict[str, Any], first: bool) -> Iterator[LLM]:
    """The configuration's LLM, warmed up; says where it runs when `first`."""
    start = time.perf_counter()
    with LLM(model=model, **{**engine, "speculative": run.speculative, "max_num_seqs": len(DEMO_PROMPTS)}) as llm:
        if first:
            say(f"running on {_where(llm)}")
        run.device = llm.config.device
        run.cpu_threads = None if llm.cpu_threads is None else llm.cpu_threads.count
        llm.generate(DEMO_PROMPTS, SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS), use_tqdm=False)
        say(f"[{run.name}] loaded and warmed up in {time.perf_counter() - start:.1f} s")
        yield llm


def _print_table(runs: list[SpecRun], max_tokens: int, repeats: int) -> None:
    base = runs[0]
    say()
    say(f"greedy decode of {len(DEMO_PROMPTS)} prompts x {max_tokens} tokens, median and range of {repeats} "
        "round(s); speed-up: this row's tok/s over no drafts' in the same round:")
    say("| drafts | tok/s | tok/s range | speed-up | speed-up range | acceptance | tokens/step | same tokens as none |")
    say("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in runs:
        acc = "-" if r.acceptance is None else f"{r.acceptance:.0%}"
        ratios = r.speedups(base)
        spread = "-" if r is base else f"{min(ratios):.2f}-{max(ratios):.2f}x"
        same = sum(a == b for a, b in zip(r.token_ids, base.token_ids, strict=True))
        say(f"| {r.name} | {r.median:.0f} | {r.spread} | {statistics.median(ratios):.2f}x | {spread} | {acc} | "
            f"{r.tokens_per_step:.2f} | {same}/{len(base.token_ids)} |")
    on_cpu = base.device.startswith("cpu")
    for r in runs[1:]:
        assert r.speculative is not None
        say(verdict(r, base, r.speculative["num_speculative_tokens"], on_cpu))
    if on_cpu:
        say(cpu_note(runs))


def cpu_note(runs: list[SpecRun]) -> str:
    """That CPU figures are noisy, and how much of its threads' time this process got."""
    note = ("CPU figures are noisy: other processes and the OS scheduler move them by tens of percent from run to "
            "run (the range columns show this run's); --repeats R takes more rounds.")
    threads = runs[0].cpu_threads or 1
    share = statistics.median(b for r in runs for b in r.cpu_busy) / threads
    if share < 0.9:
        note += (f" Here the demo's {threads} thread{'' if threads == 1 else 's'} ran {share:.0%} of the time (other "
                 "processes held the cores the rest), so its tok/s are below an idle machine's.")
    return note


def verdict(run: SpecRun, base: SpecRun, num_drafts: int, on_cpu: bool) -> str:
    """One sentence on a drafting row against no drafts: faster or slower when every round says
    so, else within the noise; with the step time and tokens per step behind it."""
    ratios = run.speedups(base)
    speedup = statistics.median(ratios)
    # Seconds per step relative to no drafts: (tokens / step) / (tokens / s).
    step_time = (run.tokens_per_step / run.median) / (base.tokens_per_step / base.median)
    advance = run.tokens_per_step / base.tokens_per_step
    why = (f"a step took {step_time:.1f}x as long as without drafts (it proposes up to {num_drafts} drafts per row "
           f"and verifies them with the row's token) and advanced {advance:.2f}x as many tokens")
    if max(ratios) < 1:
        cpu = " A step's time on a CPU grows with the tokens it runs, so drafts pay only when most are accepted."
        return (f"{run.name}: {speedup:.2f}x: slower than no drafts; drafts cost more than they save here: {why}."
                + (cpu if on_cpu else ""))
    if min(ratios) > 1:
        return f"{run.name}: {speedup:.2f}x faster than no drafts: {why}."
    return (f"{run.name}: {speedup:.2f}x, but the rounds disagree ({min(ratios):.2f}-{max(ratios):.2f}x): "
            "no clear difference from no drafts here.")


def _where(llm: LLM) -> str:
    where = f"{llm.config.device} ({llm.config.dtype})"
    if llm.cpu_threads is not None:
        count = llm.cpu_threads.count
        where += f", {count} CPU thread{'' if count == 1 else 's'}: {llm.cpu_threads.why}; --threads N sets it"
    return where


def _has_mtp(model: str) -> bool:
    return ModelConfig.from_dir(resolve_model(model)).num_nextn_predict_layers > 0


def _print_continuations(texts: list[str]) -> None:
    for i, (prompt, text) in enumerate(zip(DEMO_PROMPTS, texts, strict=True)):
        say(f"{'-' * 30} prompt {i + 1}/{len(DEMO_PROMPTS)} {'-' * 30}")
        say(prompt + text)
    say("-" * 72)


def _print_json_answer(llm: LLM) -> None:
    """The model's greedy answer to JSON_PROMPT under JSON_SCHEMA (structured outputs): a code
    model that never writes JSON by itself writes it under the grammar."""
    constraint = StructuredOutputsParams(json=JSON_SCHEMA, disable_any_whitespace=True)
    params = SamplingParams(temperature=0.0, max_tokens=100, structured_outputs=constraint)
    say(f"structured outputs: {JSON_PROMPT!r} answered under the JSON schema {json.dumps(JSON_SCHEMA)}:")
    try:
        say(llm.generate(JSON_PROMPT, params, use_tqdm=False)[0].outputs[0].text)
    except StructuredOutputError as e:  # xgrammar is an optional extra
        say(f"(not shown: {e})")
    say("-" * 72)
