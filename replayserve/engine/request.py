"""A request as it travels through the engine: its tokens, outputs, state and prefix-cache keys."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from replayserve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int
    output_token_ids: list[int] = field(default_factory=list)
    # With SamplingParams.logprobs: per output token, {token id: log-probability} of it and the
    # top-k (`SampleResult.logprobs`), and its rank; empty otherwise.
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    output_ranks: list[int] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs: the same for prompt tokens 1, 2, ... as they are scored.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_ranks: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose KV and state are in the cache; reset to 0 by preemption (recompute).
    num_computed_tokens: int = 0
    # Set once the request has sampled after its (re)admission prefill: it now decodes.
    decoding: bool = False
    state_slot: int | None = None
    finish_reason: str | None = None
    # What stopped it: the stop token id or stop string; None for EOS, length and abort.
    stop_reason: int | str | None = None
    text: str = ""
    # Prefix-cache keys besides the tokens (e.g. a cache salt): requests share blocks only when equal.
    extra_keys: tuple = ()
    # Prefix cache: keys and chained hashes of the full blocks of all_token_ids so far, extended as
    # the request grows (tokens are only ever appended, so they stay valid across preemption).
    block_keys: list = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    # mamba_cache_mode='align': a grid point where the prefill must keep a state (a branch point).
    branch_point: int | None = None

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt log-probabilities were asked for and some are not computed yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_range(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole prompt and output (a decode
        row reads one token a step; the concatenation would copy the whole context)."""
        prompt = self.prompt_token_ids
        if start >= len(prompt):
            return self.output_token_ids[start - len(prompt) : end - len(prompt)]
        if end <= len(prompt):
            return prompt[start:end]
        return prompt[start:] + self.output_token_ids[: end - len(prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
