"""Startup warm-up: compile and capture, before the first request, what serving will run.

On CUDA a fresh engine compiles each Triton kernel variant on its first launch (hundreds of
milliseconds each, mid-step) and captures each decode graph on its first use, so its first wave
of requests ran 1.4-1.8x slower than the second on the same card (issue 38). A kernel's variants
follow a step's shape: compile-time sizes taken from powers of two of its token or row count (the
MoE routing's and alignment's tiles, ReplaySSM's cursor and flush blocks), the width of its verify
rows, and which optional paths run (prefix-caching captures). Per-step counts themselves are not
specialised on (`do_not_specialize` in `ops/`), so the shapes below stand for steps of any size;
on CUDA, `tests/engine/test_warmup.py` checks that serving after the warm-up compiles nothing.

`run_warm_up` drives dummy greedy requests through the engine's own scheduler and runner:

1. each distinct MoE layer at every token count up to `max_num_batched_tokens`, alone (its
   variants follow the count in ways no short list covers), and every decode graph: each padded
   batch size at each row width (`Runner.prepare_for_serving`);
2. prefill-only steps of 1, 2, 4, ... tokens up to `max_num_batched_tokens`, the last also the
   activations' peak, which the allocator then holds;
3. steps with 1, 2, 4, ... up to `max_num_seqs` decoding requests, beside a prefill chunk that
   fills the budget (mixed steps) and alone; with ReplaySSM the first for a window of steps, so
   that its row flushes;
4. with speculative decoding, the same with the proposer's drafts, and with verify rows of 1, 2,
   ... k drafts (in 3 the rows take none: whether a proposer finds drafts depends on the tokens);
5. with prefix caching, one prompt run twice, the second from the first's cached prefix (a state
   copy, a prefill from a grid point, boundary states published in decode).

`Engine.warm_up` puts back what this changes (request ids, counters, the prefix cache).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from replayserve.engine.request import Request, Status
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.proposers import Proposer

if TYPE_CHECKING:
    from replayserve.engine.engine import Engine

logger = logging.getLogger(__name__)

# Warm-up prompts repeat a pattern this long, so the n-gram proposer finds drafts in them.
PATTERN = 3


@dataclass(frozen=True)
class WarmupReport:
    """What `run_warm_up` ran."""

    graphs: tuple[tuple[int, int], ...]  # (batch size, row width) of the fixed-shape decode path prepared
    prefill_tokens: tuple[int, ...]  # token counts of the prefill-only steps
    decode_rows: tuple[int, ...]  # decoding requests of the mixed and decode steps
    verify_drafts: tuple[int, ...]  # drafts per verify row (speculative decoding)
    prefix_hit: bool  # a request ran from a cached prefix
    steps: int
    requests: int
    seconds: float

    def describe(self) -> str:
        parts = [f"{len(self.graphs)} decode graph shapes" if self.graphs else "no decode graphs",
                 f"prefill steps of {_span(self.prefill_tokens)} tokens",
                 f"{_span(self.decode_rows)} decoding requests"]
        if self.verify_drafts:
            parts.append(f"verify rows of {_span(self.verify_drafts)} drafts")
        if self.prefix_hit:
            parts.append("a prefix hit")
        return (f"{', '.join(parts)}: {self.steps} steps of {self.requests} dummy requests in "
                f"{self.seconds:.1f} s")


def _span(values: Sequence[int]) -> str:
    if not values:
        return "no"
    return f"{values[0]}..{values[-1]}" if len(values) > 1 else str(values[0])


def powers_of_two_to(limit: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `limit`, then `limit` itself."""
    return tuple(sorted({1 << i for i in range(limit.bit_length()) if 1 << i < limit} | {limit}))


class FixedDrafts(Proposer):
    """Proposes `count` copies of a request's last token: verify rows of a chosen width."""

    def __init__(self, count: int) -> None:
        self.count = count

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [token_ids[-1]] * min(k, self.count)


class _Driver:
    """Adds dummy requests and steps the engine; every request it adds is aborted by `finish`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.longest = engine.config.resolved_max_model_len - 1  # the longest prompt a request may have
        self.live: list[Request] = []
        self.steps = self.requests = 0

    def add(self, length: int, max_tokens: int, salt: str | None = None) -> Request:
        """A greedy request of a `length`-token prompt. Its own cache salt unless one is given: no
        warm-up prompt finds another's prefix unless it is meant to."""
        period = min(PATTERN, self.engine.config.model.vocab_size)
        prompt = [i % period for i in range(length)]
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = self.engine.add_request(prompt, params, cache_salt=salt or f"warm-up {self.requests}")
        self.requests += 1
        self.live.append(request)
        return request

    def step(self) -> None:
        if self.engine.has_unfinished():
            self.engine.step()
            self.steps += 1

    def step_until(self, done: Callable[[], bool]) -> None:
        while self.engine.has_unfinished() and not done():
            self.step()

    def finish(self) -> None:
        """Aborts every request added, then lands a step still on the device (async scheduling)."""
        for request in self.live:
            self.engine.abort(request)
        self.live.clear()
        self.step_until(lambda: False)

    def prefill_steps(self) -> tuple[int, ...]:
        """Prefill-only steps of 1, 2, 4, ... tokens up to the budget (as many prompts as one step
        of that many tokens needs); each request ends with its first token."""
        config = self.engine.config
        counts = powers_of_two_to(min(config.max_num_batched_tokens, config.max_num_seqs * self.longest))
        for total in counts:
            for length in [self.longest] * (total // self.longest) + [total % self.longest]:
                if length:
                    self.add(length, max_tokens=1)
            self.run_out()
        return counts

    def run_out(self) -> None:
        """Steps until every request ends by itself."""
        self.step_until(lambda: False)
        self.live.clear()

    @contextmanager
    def proposing(self, proposer: Proposer) -> Iterator[None]:
        """Drafts from `proposer` meanwhile, when the engine speculates."""
        own = self.engine.proposer
        if own is not None:
            self.engine.proposer = proposer
        try:
            yield
        finally:
            self.engine.proposer = own

    def decode_steps(self) -> tuple[int, ...]:
        """Mixed and decode-only steps with 1, 2, 4, ... up to max_num_seqs decoding requests: as
        plain decode rows (no drafts: any proposer finds none for some rows; with ReplaySSM the
        first for a window and one step more, so that its row flushes), then, when the engine
        speculates, with its own proposer's drafts (a model proposer's kernels follow the rows)."""
        config = self.engine.config
        flush = config.resolved_replay_window + 1 if config.ssm_backend == "replay" else 2
        counts = powers_of_two_to(config.max_num_seqs)
        with self.proposing(FixedDrafts(0)):
            for rows in counts:
                self.mixed_and_decode(rows, flush if rows == counts[0] else 2)
        if self.engine.proposer is not None:
            for rows in counts:
                self.mixed_and_decode(rows, 2)
        return counts

    def mixed_and_decode(self, rows: int, decode_steps: int) -> None:
        """`rows` requests decoding beside a prompt that fills the rest of the budget over two
        steps (when a row is left for it), then `decode_steps` steps of them alone."""
        config = self.engine.config
        decoders = [self.add(min(PATTERN + 1, self.longest), max_tokens=config.resolved_max_model_len)
                    for _ in range(rows)]
        self.step_until(lambda: all(r.output_token_ids or r.status is Status.FINISHED for r in decoders))
        room = config.max_num_batched_tokens - rows * config.tokens_per_step
        if rows < config.max_num_seqs and room > 0:
            prompt = self.add(min(2 * room, self.longest), max_tokens=1)
            self.step_until(lambda: prompt.status is Status.FINISHED)
        for _ in range(decode_steps):
            self.step()
        self.finish()

    def verify_steps(self) -> tuple[int, ...]:
        """With speculative decoding: mixed and decode-only steps whose rows verify 1, 2, ... k
        drafts (an eager verify's width is a compile-time size; the graphs pad rows to 1 + k)."""
        spec = self.engine.config.speculative
        if spec is None:
            return ()
        drafts = tuple(range(1, spec.num_speculative_tokens + 1))
        for count in drafts:
            with self.proposing(FixedDrafts(count)):
                self.mixed_and_decode(1, 2)
        return drafts

    def prefix_hit(self) -> bool:
        """With prefix caching: one prompt run twice under one salt, long enough to hold a cached
        grid point before its last token (the second request's hit) and to reach the next one in
        decode (where `all` publishes a state). Returns whether the hit happened."""
        cache = self.engine.cache
        if not self.engine.config.enable_prefix_caching:
            return False
        length = min(2 * cache.state_block - 1, self.longest - 3)
        if length <= cache.state_block:  # no grid point before the last prompt token
            return False
        hits = cache.metrics.hits
        for _ in range(2):
            self.add(length, max_tokens=3, salt="warm-up prefix")
            self.run_out()
        return cache.metrics.hits > hits


def run_warm_up(engine: Engine) -> WarmupReport:
    """Runs the module's steps on an idle engine and aborts its requests, also when one raises;
    logs and returns what ran. Changes request ids, counters and the prefix cache (`Engine.warm_up`
    puts them back)."""
    start = time.perf_counter()
    driver = _Driver(engine)
    try:
        graphs = engine.runner.prepare_for_serving()
        prefill = driver.prefill_steps()
        rows = driver.decode_steps()
        drafts = driver.verify_steps()
        hit = driver.prefix_hit()
    finally:
        driver.finish()
    report = WarmupReport(graphs, prefill, rows, drafts, hit, driver.steps, driver.requests,
                          time.perf_counter() - start)
    logger.info("warm-up: %s", report.describe())
    return report
