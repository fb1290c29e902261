"""A randomized differential fuzzer of the engine (float64, CPU).

Each seeded workload picks an engine configuration (SSM backend, prefix caching and mode,
speculation by n-gram, draft model, MTP or an oracle, or else async scheduling, small pools,
small token budgets) and a
stream of greedy requests (shared prefixes, stop tokens, stop strings, arrivals while others run,
aborts), and injects exceptions (``RuntimeError`` or ``KeyboardInterrupt``) at every stage of a
step: drafting, the forward, the SSM step's end, stop-string decoding, publishing, the update,
finishing (an async step's launch and read-back count as the forward's start and end). After
each fault the engine keeps stepping. The outcome must be:

- every request that finished has exactly the tokens (and stop text) of the plain solo run:
  the request alone in a default engine, its greedy path cut by the same stop rules;
- every aborted request's tokens are a prefix of that path;
- every KV block, live state slot and boundary slot is free, and the pools' books agree.

The CI test runs a few dozen workloads; a longer run is
``python -m tests.engine.fuzz_engine --workloads 2000 [--seed 0]``.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.engine.request import Request, Status
from replayserve.speculative.proposers import OracleProposer

STAGES = ("propose", "execute_before", "execute_after", "ssm_end_step", "decode", "publish_after", "update",
          "finish")
MAX_MODEL_LEN = 64
VOCAB = 512
PATH_LEN = 16  # greedy tokens known per prompt: max_tokens stays below it


class InjectedFault(RuntimeError):
    """The fuzzer's own exception: what a failing stage raises."""


@dataclass
class Models:
    target: Path  # has MTP layers, so every proposer runs on it
    draft: Path


def make_models(root: Path) -> Models:
    return Models(
        target=make_tiny(root / "target", seed=0, layers="M*-ME", num_nextn_predict_layers=1,
                         mtp_layer_types=("full_attention", "moe")),
        draft=make_tiny(root / "draft", seed=1, layers="M*-"),
    )


def prompt_pool(seed: int = 0, size: int = 16) -> list[list[int]]:
    """Prompts the workloads draw from (so their solo paths are computed once): most share one of
    two system prefixes, cut at random lengths, so prefix hits, branch points and evictions occur."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(18)] for _ in range(2)]
    pool = []
    for _ in range(size):
        shared = rng.choice(systems)[: rng.randint(0, 18)] if rng.random() < 0.75 else []
        pool.append(shared + [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))])
    return pool


class Reference:
    """Greedy paths of requests run alone in a default engine, memoized by prompt."""

    def __init__(self, models: Models) -> None:
        self.llm = LLM(model=str(models.target), dtype="float64", device="cpu", max_num_seqs=1,
                       max_model_len=MAX_MODEL_LEN)
        self.tokenizer = self.llm.tokenizer
        self.pool = prompt_pool()
        self._paths: dict[tuple[int, ...], list[int]] = {}

    def path(self, prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in self._paths:
            params = SamplingParams(temperature=0.0, max_tokens=PATH_LEN, ignore_eos=True)
            self._paths[key] = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].token_ids
        return self._paths[key]

    def expected(self, prompt: list[int], params: SamplingParams) -> tuple[list[int], str, str | None]:
        """(tokens, finish reason, stop text or None) under the request's stop rules."""
        path = self.path(prompt)
        limit = min(params.max_tokens, MAX_MODEL_LEN - len(prompt))
        assert limit <= len(path)
        for n in range(1, limit + 1):
            out = path[:n]
            if out[-1] in params.stop_token_ids:
                return out, "stop", None
            if params.stop:
                text = self.tokenizer.decode(out)
                hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
                if hits:
                    return out, "stop", text[: min(hits)]
        return path[:limit], "length", None


@dataclass
class Arrival:
    prompt: list[int]
    params: SamplingParams
    step: int
    abort_step: int | None


@dataclass
class Workload:
    seed: int
    options: dict[str, Any]
    arrivals: list[Arrival]
    faults: dict[int, tuple[str, type[BaseException]]] = field(default_factory=dict)  # step -> (stage, error)


SPEC_METHODS = (None, "ngram", "draft", "mtp", "oracle")


def make_models_of(root: Path, family: str) -> Models:
    """A target and a draft model of another family (make-tiny's `--family`); they have no MTP
    layers, so their workloads draw from SPEC_METHODS without "mtp"."""
    return Models(target=make_tiny(root / "target", seed=0, family=family),
                  draft=make_tiny(root / "draft", seed=1, family=family))


def make_workload(seed: int, reference: Reference, models: Models,
                  spec_methods: tuple[str | None, ...] = SPEC_METHODS) -> Workload:
    rng = random.Random(seed)
    bs = rng.choice((4, 8))
    k = rng.randint(1, 4)
    spec_method = rng.choice(spec_methods)
    mode = rng.choice((None, "none", "align", "all"))
    grid = bs * rng.choice((1, 2))
    options: dict[str, Any] = {
        "block_size": bs, "max_num_seqs": rng.randint(2, 4), "ssm_backend": rng.choice(("baseline", "replay")),
        "max_num_batched_tokens": max(rng.randint(6, 32), k + 1),
        "num_kv_blocks": rng.randint(MAX_MODEL_LEN // bs + 2, 3 * MAX_MODEL_LEN // bs),
        "replay_window": rng.randint(k + 1, 8), "enable_prefix_caching": mode is not None,
        "mamba_cache_mode": mode or "none", "mamba_block_size": grid, "num_mamba_cache_slots": rng.randint(1, 6),
    }
    arrivals = []
    for _ in range(rng.randint(2, 5)):
        prompt = rng.choice(reference.pool)
        path = reference.path(prompt)
        stop_ids: list[int] = []
        stop: list[str] = []
        roll = rng.random()
        if roll < 0.35:
            stop_ids = [path[rng.randrange(min(len(path), 10))]]
        elif roll < 0.5:
            text = reference.tokenizer.decode(path[: rng.randint(2, 10)])
            piece = text[rng.randrange(len(text)):][:3] if text else ""
            stop = [piece] if piece else []
        params = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, PATH_LEN - 2), ignore_eos=True,
                                stop_token_ids=stop_ids, stop=stop)
        start = rng.randint(0, 6)
        arrivals.append(Arrival(prompt, params, start, start + rng.randint(0, 8) if rng.random() < 0.15 else None))
    if spec_method is not None:
        spec: dict[str, Any] = {"method": spec_method, "num_speculative_tokens": k}
        if spec_method == "draft":
            spec["model"] = str(models.draft)
        if spec_method == "oracle":
            paths = {tuple(a.prompt): reference.path(a.prompt) for a in arrivals}
            spec = {"method": "custom", "num_speculative_tokens": k,
                    "proposer": OracleProposer(paths, rng.choice((0.0, 0.0, 0.3)), VOCAB, seed=seed)}
        options["speculative"] = spec
    faults = {}
    for step in range(40):
        if rng.random() < 0.12:
            faults[step] = (rng.choice(STAGES), rng.choice((InjectedFault, KeyboardInterrupt)))
    # Drawn last, so the draws above are what they were before the option existed.
    options["async_scheduling"] = spec_method is None and rng.random() < 0.5
    return Workload(seed, options, arrivals, faults)


class FaultInjector:
    """Wraps each stage of the engine's step so that a fault armed for it raises once."""

    def __init__(self, llm: LLM) -> None:
        self.armed: tuple[str, type[BaseException]] | None = None
        self.fired = 0
        engine = llm.engine
        self._wrap(engine.proposer, "propose_batch", "propose", after=False)
        self._wrap(engine.runner, "execute", "execute_before", after=False)
        self._wrap(engine.runner, "execute", "execute_after", after=True)
        # Async scheduling's steps: launched (the forward queued), then read back.
        self._wrap(engine.runner, "launch_decode", "execute_before", after=False)
        self._wrap(engine.runner, "collect", "execute_after", after=True)
        self._wrap(engine.runner.ssm, "end_step", "ssm_end_step", after=True)
        self._wrap(engine.tokenizer, "decode", "decode", after=False)
        self._wrap(engine.cache, "publish", "publish_after", after=True)
        self._wrap(engine.scheduler, "update", "update", after=False)
        self._wrap(engine.scheduler, "finish", "finish", after=False)

    def _wrap(self, obj: object, name: str, stage: str, after: bool) -> None:
        if obj is None:
            return
        inner = getattr(obj, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if not after:
                self._maybe_raise(stage)
            out = inner(*args, **kwargs)
            if after:
                self._maybe_raise(stage)
            return out

        setattr(obj, name, wrapped)

    def _maybe_raise(self, stage: str) -> None:
        if self.armed is not None and self.armed[0] == stage:
            error = self.armed[1]
            self.armed = None
            self.fired += 1
            raise error(f"injected at {stage}")


def run_workload(workload: Workload, reference: Reference, models: Models) -> dict[str, int]:
    """Runs one workload; raises AssertionError on a mismatch or a leak. Returns counts."""
    llm = LLM(model=str(models.target), dtype="float64", device="cpu", max_model_len=MAX_MODEL_LEN,
              **workload.options)
    engine = llm.engine
    injector = FaultInjector(llm)
    pending = sorted(workload.arrivals, key=lambda a: a.step)
    live: list[tuple[Arrival, Request]] = []
    step = 0
    while pending or engine.has_unfinished():
        if step > 3000:
            raise AssertionError(f"workload {workload.seed}: no progress after {step} steps")
        while pending and (pending[0].step <= step or not engine.has_unfinished()):
            a = pending.pop(0)
            live.append((a, engine.add_request(a.prompt, a.params)))
        for a, request in live:
            if a.abort_step == step:
                engine.abort(request)
        if not engine.has_unfinished():
            step += 1
            continue
        if step in workload.faults:
            injector.armed = workload.faults[step]
        try:
            engine.step()
        except (InjectedFault, KeyboardInterrupt):
            pass
        injector.armed = None
        step += 1
    for a, request in live:
        assert request.status is Status.FINISHED, f"workload {workload.seed}: request {request.request_id} unfinished"
        tokens, reason, text = reference.expected(a.prompt, a.params)
        got = request.output_token_ids
        where = f"workload {workload.seed} ({workload.options}), request {request.request_id}"
        if request.finish_reason == "abort":
            assert got == tokens[: len(got)], f"{where}: aborted output {got} is not a prefix of {tokens}"
            continue
        assert (got, request.finish_reason) == (tokens, reason), \
            f"{where}: {got} {request.finish_reason} != {tokens} {reason}"
        if text is not None:
            assert request.text == text, f"{where}: text {request.text!r} != {text!r}"
    cache = engine.cache
    assert cache.kv.num_free == cache.kv.size, f"workload {workload.seed}: KV blocks leaked"
    assert cache.live.num_free == cache.live.size, f"workload {workload.seed}: live state slots leaked"
    if cache.states is not None:
        assert cache.states.num_free == cache.states.size, f"workload {workload.seed}: boundary slots leaked"
    cache.check()
    return {"steps": engine.num_steps, "faults": injector.fired, "requests": len(live)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", type=int, default=200, help="number of workloads (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="first workload seed (default 0)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        models = make_models(Path(root))
        reference = Reference(models)
        failures, totals, start = [], {"steps": 0, "faults": 0, "requests": 0}, time.time()
        for seed in range(args.seed, args.seed + args.workloads):
            try:
                counts = run_workload(make_workload(seed, reference, models), reference, models)
            except Exception as e:  # a mismatch, a leak, or an error the engine let escape
                failures.append(seed)
                print(f"FAIL workload {seed}: {type(e).__name__}: {e}", flush=True)
                continue
            for key, value in counts.items():
                totals[key] += value
        print(f"{args.workloads} workloads, {len(failures)} failed {failures[:20]}; {totals['requests']} requests, "
              f"{totals['steps']} steps, {totals['faults']} injected faults, {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
