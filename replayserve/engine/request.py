"""A request and its sampling parameters, as they travel through the engine."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. `temperature == 0` is greedy.

    logprobs: return the top-`logprobs` log-probabilities of each generated token (plus the
    sampled token's own); None returns none.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        checks = [
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", "must be finite and >= 0"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (self.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", "must be None or >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative ints"),
        ]
        for ok, option, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{option} {why}, got {getattr(self, option)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: Status = Status.WAITING
    # Tokens whose KV and state are in the cache; reset to 0 by preemption (recompute).
    num_computed_tokens: int = 0
    # Set once the request has sampled after its (re)admission prefill: it now decodes.
    decoding: bool = False
    state_slot: int | None = None
    finish_reason: str | None = None
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
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)
