"""The host's share of a constrained decode step, phase by phase, on the CPU: where the time goes
that a GPU step cannot hide behind its forward.

`bench_structured.py` on an H100 finds a constrained step slower than an unconstrained one by more
than the mask fill it overlaps with the forward. This runs the same engine step with the same
vocabulary (131072 tokens, `json_tokenizer`) and schema (`SCHEMA`) on a narrow model, so the
forward is cheap, and times each host phase of every step with `time.perf_counter` (inclusive
times of nested calls are split, so the phases add up to the step):

- plan: `Scheduler.schedule`; rows: `Grammars.masks` (before the launch);
- fill: `Grammars._fill` (the constrained rows, the last step's tokens handed to their matchers,
  the masks; on CUDA it runs while the device computes the forward);
- bitmask: its transfer (`to_device`; on the CPU a no-op) and `apply_token_bitmask`;
- sampling: the rest of `launch_sample` and `collect_sample`; forward: the rest of `Runner.execute`;
- accept: `Grammars.accept_all`; outputs: the rest of `Engine._apply` (stop rules, appends, update);
- other: the rest of `Engine.step`.

Medians over the timed steps, per batch size, constrained and not, in one process. With
`--device cuda --size nemotron-h-8b` the same phases run beside the real forward (CUDA graphs,
bfloat16): `sampling` then holds the wait for the device, so a constrained step whose sampling
shrinks by about the fill's time is one whose fill outlasts the forward.

    python benchmarks/bench_structured_host.py --batch 64 256 --steps 20
    python benchmarks/bench_structured_host.py --device cuda --size nemotron-h-8b
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_e2e import DTYPES, free_memory, random_prompts  # noqa: E402
from bench_structured import SCHEMA, json_tokenizer  # noqa: E402
from shapes import SIZES, model_config, random_model  # noqa: E402

import replayserve.engine.sampler as sampler_module  # noqa: E402
from replayserve.build import assemble_engine  # noqa: E402
from replayserve.config import EngineConfig  # noqa: E402
from replayserve.engine.engine import Engine  # noqa: E402
from replayserve.engine.grammars import Grammars  # noqa: E402
from replayserve.engine.request import Status  # noqa: E402
from replayserve.engine.runner import Runner  # noqa: E402
from replayserve.engine.scheduler import Scheduler  # noqa: E402
from replayserve.sampling_params import SamplingParams  # noqa: E402
from replayserve.structured import StructuredOutputsParams  # noqa: E402
from replayserve.tokenizer import Tokenizer as OurTokenizer  # noqa: E402

# (owner, attribute, phase): the functions timed, inclusive of what they call.
TIMED = [
    (Engine, "step", "step"),
    (Scheduler, "schedule", "plan"),
    (Grammars, "masks", "rows"),
    (Runner, "execute", "execute"),
    (Grammars, "_fill", "fill"),
    (sampler_module, "to_device", "bitmask"),
    (sampler_module, "apply_token_bitmask", "bitmask"),
    (sampler_module, "launch_sample", "launch_sample"),
    (sampler_module, "collect_sample", "collect_sample"),
    (Engine, "_apply", "apply"),
    (Grammars, "accept_all", "accept"),
]
PHASES = ["plan", "rows", "forward", "fill", "bitmask", "sampling", "accept", "outputs", "other", "step"]


@contextlib.contextmanager
def timed(spent: dict[str, float]) -> Iterator[None]:
    """Wraps every function of TIMED so each call adds its wall seconds to spent[phase]."""
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in TIMED]

    def wrap(fn: Callable, phase: str) -> Callable:
        def timed_fn(*args: object, **kwargs: object) -> object:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[phase] += time.perf_counter() - t0
        return timed_fn

    for (owner, name, phase), (_, _, fn) in zip(TIMED, originals, strict=True):
        setattr(owner, name, wrap(fn, phase))
    try:
        yield
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)


def exclusive(spent: dict[str, float]) -> dict[str, float]:
    """Inclusive seconds of the timed functions -> PHASES, which add up to the step."""
    sampling = spent["launch_sample"] - spent["bitmask"] + spent["collect_sample"]
    out = {"plan": spent["plan"], "rows": spent["rows"], "fill": spent["fill"], "bitmask": spent["bitmask"],
           "sampling": sampling, "accept": spent["accept"], "step": spent["step"],
           "forward": spent["execute"] - spent["fill"] - spent["bitmask"] - sampling,
           "outputs": spent["apply"] - spent["accept"]}
    out["other"] = out["step"] - sum(out[p] for p in PHASES if p not in ("other", "step"))
    return out


def profile(engine: Engine, prompts: list[list[int]], params: SamplingParams, warmup: int,
            steps: int) -> dict[str, float]:
    """Median milliseconds of each phase over `steps` decode steps (after prefill and `warmup`)."""
    requests = [engine.add_request(p, params) for p in prompts]
    while not all(r.decoding for r in requests):
        engine.step()
    for _ in range(warmup):
        engine.step()
    per_step: dict[str, list[float]] = defaultdict(list)
    for _ in range(steps):
        spent: dict[str, float] = defaultdict(float)
        with timed(spent):
            engine.step()
        for phase, seconds in exclusive(spent).items():
            per_step[phase].append(1e3 * seconds)
    if engine.scheduler.num_preemptions or any(r.status is not Status.RUNNING for r in requests):
        raise RuntimeError("a request was preempted or finished while timed")
    return {phase: statistics.median(per_step[phase]) for phase in PHASES}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    p.add_argument("--vocab-size", type=int, default=131072, help="the Nemotron-H-8B vocabulary's size")
    p.add_argument("--steps", type=int, default=20, help="timed decode steps; medians reported")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--threads", type=int, default=1, help="torch's intra-op threads")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", choices=sorted(SIZES), help="a benchmark shape (default: a narrow model of --vocab-size)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = (model_config(args.size) if args.size else
           dataclasses.replace(model_config("tiny"), vocab_size=args.vocab_size, hidden_size=32))
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    model = random_model(cfg, DTYPES[dtype], args.device)
    tokenizer = OurTokenizer(json_tokenizer(cfg.vocab_size))
    total = args.warmup + args.steps + 4
    print(f"host phases per decode step, ms (medians of {args.steps} steps), vocabulary {cfg.vocab_size}, "
          f"{args.device}")
    print(f"{'batch':>5} {'rows':>5} " + " ".join(f"{phase:>8}" for phase in PHASES))
    results: dict = {}
    for batch in args.batch:
        for constrained in (False, True):
            config = EngineConfig(model=cfg, dtype=dtype, device=args.device, max_num_seqs=batch,
                                  max_num_batched_tokens=max(2048, 2 * batch),
                                  max_model_len=args.prompt_len + total + 16, block_size=16)
            engine = assemble_engine(config, model, tokenizer)
            so = StructuredOutputsParams(json=SCHEMA) if constrained else None
            params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True, structured_outputs=so)
            prompts = random_prompts(batch, args.prompt_len, cfg.vocab_size, seed=batch)
            ms = profile(engine, prompts, params, args.warmup, args.steps)
            del engine
            free_memory(torch.device(args.device))
            kind = "json" if constrained else "free"
            results[f"{batch}/{kind}"] = ms
            print(f"{batch:>5} {kind:>5} " + " ".join(f"{ms[phase]:>8.3f}" for phase in PHASES), flush=True)
    return results


if __name__ == "__main__":
    main()
