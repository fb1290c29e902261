"""The engine loop: admit requests, schedule a step, run it, apply stop rules, free what ends."""

from __future__ import annotations

import itertools
import logging

import torch

from replayserve.cache.manager import CacheManager
from replayserve.config import EngineConfig
from replayserve.engine.request import Request, SamplingParams, Status
from replayserve.engine.runner import Runner
from replayserve.engine.scheduler import Scheduler
from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.spec.factory import make_proposer
from replayserve.spec.metrics import SpecMetrics
from replayserve.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: EngineConfig, model: NemotronHForCausalLM, tokenizer: Tokenizer | None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.cache = CacheManager(
            config.resolved_num_kv_blocks, config.block_size, config.max_num_seqs,
            config.resolved_num_mamba_cache_slots, config.enable_prefix_caching,
            has_mamba=config.model.num_mamba_layers > 0, state_block=config.resolved_mamba_block_size,
        )
        spec = config.speculative
        self.runner = Runner(config, model)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_num_batched_tokens, self.cache,
                                   config.mamba_cache_mode, make_proposer(config, self.runner),
                                   spec.num_speculative_tokens if spec else 0, config.resolved_max_model_len)
        self.spec_metrics = SpecMetrics()
        self._ids = itertools.count()
        self._generators: dict[str, torch.Generator] = {}
        self.num_generated_tokens = 0
        self.num_steps = 0

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises ValueError for a request the engine cannot serve; touches no state."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"expected SamplingParams, got {type(params).__name__}")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty: it needs at least one token")
        vocab = self.config.model.vocab_size
        bad = [t for t in prompt_token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be ints in [0, {vocab}); got {bad[:5]}")
        limit = self.config.resolved_max_model_len
        if len(prompt_token_ids) >= limit:
            raise ValueError(
                f"the prompt has {len(prompt_token_ids)} tokens; max_model_len={limit} leaves room for "
                f"at most {limit - 1} prompt tokens"
            )
        if params.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop needs a tokenizer; the model directory has no tokenizer.json")

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
        self.scheduler.add(request)
        return request

    def get_metrics(self) -> dict[str, float]:
        """Counters since start: prefix cache (tokens, per group and usable), steps, preemptions."""
        return {**self.cache.metrics.as_dict(), **self.spec_metrics.as_dict(), "num_steps": self.num_steps,
                "num_generated_tokens": self.num_generated_tokens,
                "num_preemptions": self.scheduler.num_preemptions}

    def abort(self, request: Request) -> None:
        if request.status is not Status.FINISHED:
            self._finish(request, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[Request]:
        """Runs one step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            raise RuntimeError("the scheduler planned an empty step with requests pending")
        sampling = [self.scheduler.unfinished[s.request_id] for s in plan.seqs if s.sample]
        try:
            results = self.runner.execute(
                plan, [r.params for r in sampling], [self._generators.get(r.request_id) for r in sampling]
            )
        except BaseException:
            self.scheduler.abandon(plan)  # nothing half-written is kept or published
            raise
        stopped: list[tuple[Request, str]] = []
        for request, result in zip(sampling, results, strict=True):
            for i, token in enumerate(result.tokens):  # a verify emits several; a stop cuts them
                request.output_token_ids.append(token)
                if result.logprobs is not None:
                    request.output_logprobs.append(result.logprobs[i])
                self.num_generated_tokens += 1
                reason = self._stop_reason(request)
                if reason is not None:
                    stopped.append((request, reason))
                    break
        drafted = {s.request_id: s.num_drafts for s in plan.seqs if s.num_drafts}
        kept = {r.request_id: len(res.tokens) for r, res in zip(sampling, results, strict=True)}
        self.spec_metrics.record(drafted, kept)
        self.scheduler.update(plan, kept)
        self.num_steps += 1
        if self.config.enable_prefix_caching and logger.isEnabledFor(logging.DEBUG):
            m = self.cache.metrics
            logger.debug("step %d: %d seqs, %d tokens; prefix cache %d/%d tokens hit", self.num_steps,
                         len(plan.seqs), plan.num_tokens, m.hits, m.queries)
        for request, reason in stopped:
            self._finish(request, reason)
        return [request for request, _ in stopped]

    def _stop_reason(self, request: Request) -> str | None:
        p, token = request.params, request.output_token_ids[-1]
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.config.model.eos_token_ids):
            return "stop"
        if p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.output_token_ids)
            hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
            if hits:
                request.text = text[: min(hits)]
                return "stop"
        if len(request.output_token_ids) >= p.max_tokens or request.num_tokens >= self.config.resolved_max_model_len:
            return "length"
        return None

    def _finish(self, request: Request, reason: str) -> None:
        self.scheduler.finish(request, reason)
        if self.runner.hidden_store is not None:
            self.runner.hidden_store.forget(request.request_id)
        self._generators.pop(request.request_id, None)
        truncated_by_stop_string = reason == "stop" and request.text
        if self.tokenizer is not None and not truncated_by_stop_string:
            request.text = self.tokenizer.decode(request.output_token_ids)
