"""How to sample a request: `SamplingParams`, part of the public API (`from replayserve import
SamplingParams`), checked when it is made."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from replayserve.structured.params import StructuredOutputsParams

# Sampling computes in float32 (float64 only for float64 logits), so every float option must be a
# value float32 holds: a smaller magnitude than its smallest normal number rounds to 0 (or keeps a
# few bits as a subnormal), a larger one than its largest to inf. Either turns a penalty or a
# temperature into a division by 0 or inf: repetition_penalty=1e-300 sampled token 0 forever.
FLOAT32_TINY = 2.0**-126
FLOAT32_MAX = (2 - 2.0**-23) * 2.0**127
# Below this the temperature-scaled logits overflow float32; 0 means greedy.
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = FLOAT32_TINY
MAX_SEED = 2**64 - 1
# The float32 range as refusals print it (rounded inwards: the printed bounds are accepted).
_TINY, _MAX = f"{FLOAT32_TINY:.3g}", f"{FLOAT32_MAX:.2g}"
_WHY = " (float32, which sampling computes in, rounds smaller magnitudes to 0 and larger ones to inf)"


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _real_in(value: object, low: float, high: float) -> bool:
    """A real number in [low, high]. Compared, never converted: NaN fails, and an int too large
    for a float compares exactly (math.isfinite(10**400) raises OverflowError)."""
    return _is_real(value) and low <= value <= high  # type: ignore[operator]


def _float32_holds(value: float) -> bool:
    """0, or a magnitude float32 holds as a normal number."""
    return value == 0 or FLOAT32_TINY <= abs(value) <= FLOAT32_MAX


def _penalty_ok(value: object) -> bool:
    """presence_penalty / frequency_penalty: 0 (off) or a float32-held number in [-2, 2]."""
    return _real_in(value, -2, 2) and _float32_holds(value)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request; every field is checked here, so a request that would make a
    step fail is refused before it is queued. `temperature == 0` is greedy.

    stop: a string or a list of strings; the output ends before the first one found.
    n: completions per prompt. With a seed, completion i samples from seed + i, so they differ.
    min_tokens: before that many tokens, EOS (unless ignored) and stop_token_ids cannot be
    sampled and stop strings are not looked for. presence_penalty / frequency_penalty /
    repetition_penalty / min_p: as in vLLM (`engine/penalties.py` defines them); a request that
    uses penalties or min_tokens takes no speculative drafts. include_stop_str_in_output: the text
    keeps the stop string that ended it.
    top_k: -1 or 0 (off) or >= 1. seed: an int in [0, 2**64) or None.
    logprobs: return the top-`logprobs` log-probabilities of each generated token (plus the
    sampled token's own); None returns none. The engine also checks it against the vocabulary.
    prompt_logprobs: likewise for each prompt token after the first, given the tokens before it;
    such a request reads no prefix-cache hit until they are computed (a hit skips the positions).
    structured_outputs: the grammar the output follows (`StructuredOutputsParams`: a JSON schema,
    a regex, a choice, an EBNF grammar or any JSON object), as in vLLM; the engine checks that it
    can honour it when the request is added.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | tuple[str, ...] | list[str] = ()
    stop_token_ids: tuple[int, ...] | list[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    n: int = 1
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # one stop string, as in vLLM and the OpenAI API
            object.__setattr__(self, "stop", (self.stop,))
        for option in ("stop", "stop_token_ids"):
            value = getattr(self, option)
            if not isinstance(value, list | tuple):
                raise ValueError(f"SamplingParams.{option} must be a list, got {value!r}")
            object.__setattr__(self, option, tuple(value))
        t, p = self.temperature, self.top_p
        checks = [
            (_real_in(t, 0, FLOAT32_MAX) and (t == 0 or t >= MIN_TEMPERATURE), "temperature",
             f"must be 0 (greedy) or a number in [{MIN_TEMPERATURE}, {_MAX}]"),
            (_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k",
             "must be an int: -1 or 0 (off) or >= 1"),
            (_real_in(p, MIN_TOP_P, 1), "top_p", f"must be a number in [{_TINY}, 1]{_WHY}"),
            (self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
             "must be None or an int in [0, 2**64)"),
            (_is_int(self.max_tokens) and self.max_tokens >= 1, "max_tokens", "must be an int >= 1"),
            (self.logprobs is None or (_is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
             "must be None or an int >= 0"),
            (self.prompt_logprobs is None or (_is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
             "prompt_logprobs", "must be None or an int >= 0"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "must be non-negative ints"),
            (isinstance(self.ignore_eos, bool), "ignore_eos", "must be a bool"),
            (_is_int(self.n) and self.n >= 1, "n", "must be an int >= 1"),
            (_is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens, "min_tokens",
             f"must be an int in [0, max_tokens={self.max_tokens}]"),
            (_penalty_ok(self.presence_penalty), "presence_penalty",
             f"must be 0 (off) or a number in [-2, 2] at least {_TINY} in magnitude{_WHY}"),
            (_penalty_ok(self.frequency_penalty), "frequency_penalty",
             f"must be 0 (off) or a number in [-2, 2] at least {_TINY} in magnitude{_WHY}"),
            (_real_in(self.repetition_penalty, FLOAT32_TINY, FLOAT32_MAX), "repetition_penalty",
             f"must be a number in [{_TINY}, {_MAX}], 1 for off{_WHY}"),
            (_real_in(self.min_p, 0, 1) and _float32_holds(self.min_p), "min_p",
             f"must be 0 (off) or a number in [{_TINY}, 1]{_WHY}"),
            (isinstance(self.include_stop_str_in_output, bool), "include_stop_str_in_output", "must be a bool"),
            (self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
             "structured_outputs", "must be None or a StructuredOutputsParams"),
            # Once its grammar is complete the output may only end; banning EOS then leaves no token.
            (self.structured_outputs is None or self.min_tokens == 0, "min_tokens",
             "must be 0 with structured_outputs (the grammar decides where the output may end)"),
        ]
        for ok, option, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{option} {why}, got {getattr(self, option)!r:.80}")
        if self.top_k == 0:
            object.__setattr__(self, "top_k", -1)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_completion(self, index: int) -> SamplingParams:
        """The params of completion ``index`` of ``n``: with a seed, completion i samples from
        seed + i (mod 2**64), so the completions differ and each is reproducible on its own. The
        prompt's log-probabilities are the same for every completion: the first scores them."""
        if index == 0:
            return self
        seed = None if self.seed is None else (self.seed + index) % (MAX_SEED + 1)
        return dataclasses.replace(self, seed=seed, prompt_logprobs=None)
