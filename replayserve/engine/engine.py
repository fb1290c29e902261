"""The engine loop: admit requests, schedule a step, run it, apply stop rules, free what ends."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import NamedTuple

import torch

from replayserve.cache.manager import CacheManager, CacheMetrics
from replayserve.config import EngineConfig
from replayserve.engine.grammars import Grammars
from replayserve.engine.penalties import uses_history
from replayserve.engine.prompt_logprobs import PromptScores
from replayserve.engine.request import Request, Status
from replayserve.engine.request_checks import validate_request
from replayserve.engine.runner import Runner
from replayserve.engine.sampler import PendingSample, SampleResult
from replayserve.engine.scheduler import Scheduler, StepPlan
from replayserve.engine.warmup import WarmupReport, run_warm_up
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.metrics import SpecMetrics
from replayserve.speculative.proposers import DraftRequest, Proposer
from replayserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Stop(NamedTuple):
    """Why a request ends: "stop" or "length"; its text cut before a stop string (else None
    until the final text is decoded); the stop token id or string that matched (else None)."""

    reason: str
    text: str | None
    cause: int | str | None


class _Launched(NamedTuple):
    """A plain decode step on the device whose tokens the host has not read (async scheduling)."""

    plan: StepPlan
    requests: list[Request]  # each row's request, in plan order
    rewind: list[tuple[torch.Generator, torch.Tensor]]  # seeded generators' states before its draws
    pending: PendingSample | None  # None: only its forward is queued (`logits`); its sampling waits for masks
    logits: torch.Tensor | None = None


class Engine:
    def __init__(self, config: EngineConfig, runner: Runner, proposer: Proposer | None,
                 tokenizer: Tokenizer | None) -> None:
        """The step loop over parts the composition root (`build.py`) made: `runner` runs the model
        (with tensor parallelism rank 0's runner, which mirrors every step to the other ranks),
        `proposer` drafts tokens when `config.speculative` asks for them. The engine builds only
        what is its own: the cache manager and the scheduler, plain data from the config."""
        self.config = config
        self.tokenizer = tokenizer
        self.cache = CacheManager(
            config.resolved_num_kv_blocks, config.block_size, config.max_num_seqs,
            config.resolved_num_mamba_cache_slots, config.enable_prefix_caching,
            has_mamba=config.model.num_recurrent_layers > 0, state_block=config.resolved_mamba_block_size,
        )
        spec = config.speculative
        self.runner = runner
        self.proposer = proposer
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.cache,
                                   config.mamba_cache_mode, spec.num_speculative_tokens if spec else 0,
                                   config.resolved_max_model_len)
        self.spec_metrics = SpecMetrics()
        self.grammars = Grammars(tokenizer, config.model.vocab_size, config.model.eos_token_ids,
                                 pin_memory=torch.device(config.device).type == "cuda")
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator] = {}
        self.num_generated_tokens = 0
        self.num_prefill_tokens = 0  # prompt (and recomputed) tokens run through prefill
        self.num_steps = 0
        self.num_overlapped_steps = 0  # steps launched before the previous step's tokens were read
        self._launched: _Launched | None = None
        if config.async_scheduling:
            logger.info("async scheduling: a plain decode step is planned and launched while the previous one runs; "
                        "steps with prefill chunks, Mamba boundary states (prefix caching), penalties or min_tokens, "
                        "and steps planned while a request waits for room or blocks run out, run synchronously; "
                        "a step with grammars queues its forward first and its masked sampling once the tokens "
                        "before it are in")

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request the engine cannot serve; touches no state."""
        validate_request(self.config, self.tokenizer is not None, prompt_token_ids, params)

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> Request:
        """Queues a request; ``cache_salt`` keeps its prefix-cache entries apart from other salts'."""
        self.validate(prompt_token_ids, params)
        request_id = str(next(self._ids))
        request = Request(request_id, list(prompt_token_ids), params, arrival=int(request_id),
                          extra_keys=() if cache_salt is None else (cache_salt,))
        if params.seed is not None and not params.greedy:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.seed)
            self._generators[request_id] = gen
        constrained = params.structured_outputs is not None
        self.scheduler.add(request, ready=not constrained)  # a grammar compiles first (`_admit_compiled`)
        if constrained:
            self.grammars.add(request)
        return request

    def get_metrics(self) -> dict[str, float]:
        """Counters since start: prefix cache (tokens, per group and usable), steps, preemptions."""
        return {**self.cache.metrics.as_dict(), **self.spec_metrics.as_dict(), "num_steps": self.num_steps,
                "num_generated_tokens": self.num_generated_tokens, "num_prefill_tokens": self.num_prefill_tokens,
                "num_preemptions": self.scheduler.num_preemptions, "num_overlapped_steps": self.num_overlapped_steps}

    def warm_up(self) -> WarmupReport:
        """Compiles and captures what serving will run, with dummy requests (`engine/warmup.py`),
        then puts back what they changed: the next request id, the counters and the prefix cache
        (emptied); every block and slot is free again and no generator has drawn. For an idle
        engine, before serving: the composition root (`build.py`) calls it on CUDA."""
        if self.has_unfinished():
            raise RuntimeError("warm_up needs an idle engine: call it before adding requests")
        next_id = next(self._ids)
        counters = (self.num_generated_tokens, self.num_prefill_tokens, self.num_steps, self.num_overlapped_steps,
                    self.scheduler.num_preemptions, self.cache.metrics, self.spec_metrics)
        self.cache.metrics, self.spec_metrics = CacheMetrics(), SpecMetrics()
        try:
            return run_warm_up(self)
        finally:
            self._ids = itertools.count(next_id)
            (self.num_generated_tokens, self.num_prefill_tokens, self.num_steps, self.num_overlapped_steps,
             self.scheduler.num_preemptions, self.cache.metrics, self.spec_metrics) = counters
            self.cache.reset_cache()

    def abort(self, request: Request) -> None:
        if request.status is not Status.FINISHED:
            self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        """Requests wait or run, or a launched step has not been read back (async scheduling)."""
        return self.scheduler.has_unfinished() or self._launched is not None

    def step(self, overlap: bool = True) -> list[Request]:
        """Runs one step; returns the requests that finished in it. overlap=False runs it
        synchronously even with async scheduling (when no step is in flight, none is left in flight).

        A step either completes or changes nothing a request can see: if anything raises (the
        forward, sampling, stop rules, publishing, an interrupt), the tokens it appended are taken
        back, seeded generators rewind, and its running requests are preempted (their states may
        be half-written; they recompute when readmitted) with every block and slot returned.

        With async scheduling a plain decode step (`Scheduler.overlappable`) is launched, and
        before its tokens are read the next one is planned and launched behind it when that is
        a plain decode step too (`Scheduler.schedule_next`): a call then completes the step the
        previous call launched and leaves its successor running on the device. A failed call
        abandons both, as above."""
        failed = self._admit_compiled()
        if self._launched is None and not (self.scheduler.waiting or self.scheduler.running):
            return failed
        return failed + self._step(overlap)

    def _step(self, overlap: bool) -> list[Request]:
        if self._launched is None:
            plan = self.scheduler.schedule(self._propose())
            if not plan.seqs:
                raise RuntimeError("the scheduler planned an empty step with requests pending")
            if not (overlap and self.config.async_scheduling and self.scheduler.overlappable(plan)):
                return self._run(plan)
            try:
                self._launched = self._launch(plan)
            except BaseException:
                self.scheduler.land_all()
                self.scheduler.abandon(plan)
                raise
        return self._complete_launched()

    def _run(self, plan: StepPlan) -> list[Request]:
        """A step run start to end: forward, sampling (its one host sync), stop rules, update."""
        unfinished = self.scheduler.unfinished
        sampling = [unfinished[s.request_id] for s in plan.seqs if s.sample]
        generators = self._generators_of(sampling)
        rewind = [(g, g.get_state()) for g in generators if g is not None]
        lengths = [len(r.output_token_ids) for r in sampling]
        scored = [(r, len(r.prompt_logprobs)) for s in plan.seqs if s.prompt_targets
                  for r in (self.scheduler.unfinished[s.request_id],)]
        num_generated = self.num_generated_tokens
        try:
            histories = ([(r.prompt_token_ids, r.output_token_ids) for r in sampling]
                         if any(uses_history(r.params) for r in sampling) else None)
            results, prompt_scores = self.runner.execute(plan, [r.params for r in sampling], generators, histories,
                                                         self.grammars.masks(plan, sampling))
            for seq in plan.seqs:
                if seq.request_id in prompt_scores:
                    _add_prompt_scores(self.scheduler.unfinished[seq.request_id], seq.start_pos,
                                       prompt_scores[seq.request_id])
            emitted, finished = self._apply(plan, sampling, results)
        except BaseException:
            self._take_back(sampling, lengths, scored, rewind, num_generated)
            self.scheduler.abandon(plan)
            raise
        if self.proposer is not None:
            self.spec_metrics.record({s.request_id: s.num_drafts for s in plan.seqs if s.num_drafts}, emitted)
        self.num_prefill_tokens += sum(len(s.token_ids) for s in plan.seqs if not s.is_decode)
        self._count_step(plan)
        return finished

    def _launch(self, plan: StepPlan, fed: torch.Tensor | None = None, defer_masks: bool = False) -> _Launched:
        """Launches a plain decode step without waiting for it; fed: the previous launched step's
        sampled tokens on the device, when the plan was made before they were known. With
        `defer_masks` a step with constrained rows gets its forward only: their masks need the
        previous step's tokens in their matchers (`_sample_deferred` queues the sampling)."""
        requests = [self.scheduler.unfinished[s.request_id] for s in plan.seqs]
        generators = self._generators_of(requests)
        rewind = [(g, g.get_state()) for g in generators if g is not None]
        self.scheduler.fly(plan)
        try:
            if defer_masks and len(self.grammars) and any(r.request_id in self.grammars for r in requests):
                return _Launched(plan, requests, rewind, None, self.runner.launch_decode_forward(plan, fed))
            pending = self.runner.launch_decode(plan, [r.params for r in requests], generators, fed,
                                                self.grammars.masks(plan, requests))
        except BaseException:
            for gen, state in rewind:
                gen.set_state(state)
            raise
        return _Launched(plan, requests, rewind, pending)

    def _sample_deferred(self, launched: _Launched) -> _Launched:
        """Queues the sampling of a step launched with its forward only, masked by its rows' grammars
        (filled now: the host works while the device runs the forward)."""
        assert launched.logits is not None
        pending = self.runner.launch_decode_sample(launched.logits, [r.params for r in launched.requests],
                                                   self._generators_of(launched.requests),
                                                   self.grammars.masks(launched.plan, launched.requests))
        return launched._replace(pending=pending, logits=None)

    def _complete_launched(self) -> list[Request]:
        """Plans and launches the step after the launched one when `schedule_next` allows, then
        waits for the launched step's tokens and applies them. Its rows whose request ended
        after it was launched (a stop in the step before, an abort) are dropped: they ran on
        memory that stays theirs until the step has landed (`Scheduler.fly`)."""
        current, self._launched = self._launched, None
        assert current is not None
        lengths = [len(r.output_token_ids) for r in current.requests]
        num_generated = self.num_generated_tokens
        following: _Launched | None = None
        try:
            next_plan = self.scheduler.schedule_next(current.plan)
            assert current.pending is not None
            if next_plan is not None:
                following = self._launch(next_plan, current.pending.tokens, defer_masks=True)
            results = self.runner.collect(current.pending)
            self.scheduler.land(current.plan)
            plan, requests = current.plan, current.requests
            live = [i for i, r in enumerate(requests) if r.status is Status.RUNNING]
            if len(live) < len(requests):
                plan = dataclasses.replace(plan, seqs=tuple(plan.seqs[i] for i in live))
                requests, results = [requests[i] for i in live], [results[i] for i in live]
            _, finished = self._apply(plan, requests, results)
            if following is not None and following.pending is None:  # its masks follow these tokens
                following = self._sample_deferred(following)
        except BaseException:
            self._take_back(current.requests, lengths, [], current.rewind, num_generated)
            self.scheduler.land_all()
            self.scheduler.abandon(current.plan)
            if following is not None:
                self.scheduler.abandon(following.plan)
            raise
        self._launched = following
        self.num_overlapped_steps += following is not None
        self._count_step(plan)
        return finished

    def _admit_compiled(self) -> list[Request]:
        """Requests whose grammar has compiled join the queue (when nothing else can run, the
        engine waits for one); those whose grammar failed to compile finish ("abort")."""
        if not self.scheduler.unready:
            return []
        ready, failed = self.grammars.compiled(block=not (self.scheduler.waiting or self.scheduler.running))
        for request in ready:
            self.scheduler.ready(request)
        for request, _ in failed:
            self._finish(request, "abort")
        return [request for request, _ in failed]

    def _generators_of(self, requests: list[Request]) -> list[torch.Generator | None]:
        # Most requests have no generator (greedy or unseeded): skip the lookup when none has.
        return ([self._generators.get(r.request_id) for r in requests] if self._generators
                else [None] * len(requests))

    def _apply(self, plan: StepPlan, sampling: list[Request],
               results: list[SampleResult]) -> tuple[dict[str, int], list[Request]]:
        """Appends each sampling row's tokens (cut by the stop rules), marks the plan's computed
        tokens and publishes what they filled, then finishes the requests that stopped. Returns
        the tokens each row appended and the finished requests."""
        outcomes = [self._outcome(r, res) for r, res in zip(sampling, results, strict=True)]
        grammar_kept = (self.grammars.accept_all(sampling, [o[0] for o in outcomes]) if len(self.grammars)
                        else [None] * len(sampling))
        emitted: dict[str, int] = {}
        stopped: list[tuple[Request, Stop]] = []
        for request, (tokens, logprobs, ranks, stop), kept in zip(sampling, outcomes, grammar_kept, strict=True):
            if kept is not None:
                # The grammar ended (its stop token): the request stops there.
                stop = stop if stop is not None and kept == len(tokens) else Stop("stop", None, None)
                tokens, logprobs, ranks = tokens[:kept], logprobs[:kept], ranks[:kept]
            request.output_token_ids.extend(tokens)
            request.output_logprobs.extend(logprobs)
            request.output_ranks.extend(ranks)
            self.num_generated_tokens += len(tokens)
            emitted[request.request_id] = len(tokens)
            if stop is not None:
                stopped.append((request, stop))
        self.scheduler.update(plan, emitted)
        for request, stop in stopped:
            request.stop_reason = stop.cause
            self._finish(request, stop.reason, stop.text)
        return emitted, [request for request, _ in stopped]

    def _take_back(self, sampling: list[Request], lengths: list[int], scored: list[tuple[Request, int]],
                   rewind: list[tuple[torch.Generator, torch.Tensor]], num_generated: int) -> None:
        """Undoes what a failed step appended (a request it finished keeps its tokens: it is
        complete) and rewinds the seeded generators to before its draws."""
        for request, n in zip(sampling, lengths, strict=True):
            if request.status is not Status.FINISHED:
                del request.output_token_ids[n:], request.output_logprobs[n:], request.output_ranks[n:]
        self.grammars.take_back(sampling, lengths)
        for request, n in scored:
            del request.prompt_logprobs[n:], request.prompt_ranks[n:]
        for gen, state in rewind:
            gen.set_state(state)
        self.num_generated_tokens = num_generated

    def _count_step(self, plan: StepPlan) -> None:
        self.num_steps += 1
        if self.config.enable_prefix_caching and logger.isEnabledFor(logging.DEBUG):
            m = self.cache.metrics
            logger.debug("step %d: %d seqs, %d tokens; prefix cache %d/%d tokens hit", self.num_steps,
                         len(plan.seqs), plan.num_tokens, m.hits, m.queries)

    def _propose(self) -> dict[str, tuple[int, ...]]:
        """Drafts for the running decode rows, proposed before the step is planned (a draft model
        or MTP layer runs here, not in the scheduler). A row the plan then leaves out (out of
        budget, preempted) drops its drafts; every proposer's drafts for k are a prefix of its
        drafts for more, so the budget's cut gives what a smaller k would have."""
        if self.proposer is None:
            return {}
        wanted = [DraftRequest(r.request_id, r.all_token_ids, room) for r in self.scheduler.running
                  if (room := self.scheduler.draft_room(r))]
        if not wanted:
            return {}
        proposed = self.proposer.propose_batch(wanted)  # one call: a model proposer batches the rows
        drafts = {r.request_id: tuple(proposed.get(r.request_id, ()))[: r.room] for r in wanted}
        return self.grammars.cut_drafts(drafts)  # a constrained row verifies what its grammar allows

    def _outcome(self, request: Request, result: SampleResult) -> tuple[list[int], list, list[int], Stop | None]:
        """What a sampled result adds to a request, without changing it: the tokens it keeps (a
        verify's are cut after the first one that stops it), their logprobs and ranks, and why it
        stops (None: it goes on), with its final text."""
        if len(result.tokens) == 1 and result.logprobs is None:  # the common decode row
            new = [result.tokens[0]]
            stop = self._stop(request, new)
            if stop is not None and stop.text is None and self.tokenizer is not None:
                stop = stop._replace(text=self.tokenizer.decode(request.output_token_ids + new))
            return new, [], [], stop
        for i in range(len(result.tokens)):
            new = list(result.tokens[: i + 1])
            stop = self._stop(request, new)
            if stop is not None or i == len(result.tokens) - 1:
                logprobs = [] if result.logprobs is None else list(result.logprobs[: i + 1])
                ranks = [] if result.ranks is None else list(result.ranks[: i + 1])
                if stop is not None and stop.text is None and self.tokenizer is not None:
                    stop = stop._replace(text=self.tokenizer.decode(request.output_token_ids + new))
                return new, logprobs, ranks, stop
        raise AssertionError("a sample result has at least one token")

    def _stop(self, request: Request, new: list[int]) -> Stop | None:
        """Why a request stops once ``new`` tokens follow its output (None: it goes on); a stop
        string's text is cut before it."""
        p, token = request.params, new[-1]
        if token in p.stop_token_ids:
            return Stop("stop", None, token)
        if not p.ignore_eos and token in self.config.model.eos_token_ids:
            return Stop("stop", None, None)
        num_output = len(request.output_token_ids) + len(new)
        if p.stop and self.tokenizer is not None and num_output >= p.min_tokens:
            text = self.tokenizer.decode(request.output_token_ids + new)
            hits = [(i, s) for s in p.stop if (i := text.find(s)) >= 0]
            if hits:
                at, first = min(hits, key=lambda hit: hit[0])
                return Stop("stop", text[: at + len(first) if p.include_stop_str_in_output else at], first)
        limit = self.config.resolved_max_model_len
        if num_output >= p.max_tokens or len(request.prompt_token_ids) + num_output >= limit:
            return Stop("length", None, None)
        return None

    def _finish(self, request: Request, reason: str, text: str | None = None) -> None:
        """``text``: the output cut before a stop string; else the whole output is decoded."""
        if text is None and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
        self.scheduler.finish(request, reason)
        self.runner.forget(request.request_id)
        self.grammars.forget(request.request_id)
        self._generators.pop(request.request_id, None)
        request.text = text or ""


def _add_prompt_scores(request: Request, start_pos: int, scores: PromptScores) -> None:
    """Appends a chunk's prompt log-probabilities (its position start_pos + i scored prompt token
    start_pos + i + 1); a chunk recomputed after a preemption scores tokens the request already
    has, which are kept as they were."""
    skip = len(request.prompt_logprobs) - start_pos
    assert skip >= 0, "prompt chunks are scored in order, with no prefix hit between them"
    request.prompt_logprobs.extend(scores.logprobs[skip:])
    request.prompt_ranks.extend(scores.ranks[skip:])
