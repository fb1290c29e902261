"""What `LLM.generate` returns, in vLLM's shapes: `RequestOutput`, `CompletionOutput`, `Logprob`.

Inside the engine a position's log-probabilities are a plain {token id: float} dict and the rank
of the token that was sampled (or, for prompt_logprobs, that followed); the `Logprob` objects,
with ranks for every entry and decoded text, are built here, once, when a request has finished.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's entry in a position's log-probabilities, as vLLM's `vllm.logprobs.Logprob`.

    logprob: its log-probability under the model's distribution (before temperature, penalties
    and truncation). rank: 1-based, the number of vocabulary tokens at least as likely as it (1 is
    the most likely; tied tokens share the larger rank). decoded_token: its text, special tokens
    included (None when the model directory has no tokenizer).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per position, {token id: Logprob}; prompt_logprobs has None for the first prompt token.
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a prompt, as vLLM shapes it.

    logprobs: per generated token, {token id: Logprob} of the sampled token and the top
    `SamplingParams.logprobs` ones; None when not asked. cumulative_logprob: the sum of the
    sampled tokens' log-probabilities when logprobs were asked, else None. finish_reason:
    "stop", "length" or "abort"; stop_reason: the stop token id or stop string that matched
    (None for EOS, length and abort).
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestOutput:
    """A prompt and its `n` completions, as vLLM shapes it. `text`, `token_ids`, `logprobs` and
    `finish_reason` are the first completion's, for callers that ask for one. prompt_logprobs:
    with `SamplingParams.prompt_logprobs`, None for the first prompt token (nothing precedes it),
    then per prompt token {token id: Logprob} of it and the top-k given its prefix."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self) -> SampleLogprobs | None:
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def to_logprobs(entries: Sequence[dict[int, float]], tokens: Sequence[int], ranks: Sequence[int],
                decode: Callable[[int], str] | None) -> SampleLogprobs:
    """The engine's per-position {id: float} dicts as {id: Logprob}.

    Args:
        entries: per position, the log-probabilities of its token and of the top-k.
        tokens: per position, the token it holds (sampled, or the prompt's).
        ranks: per position, that token's rank over the whole vocabulary (computed on the device).
        decode: a token id's text, or None for no text.

    The top-k entries' ranks follow from the dict itself: every token at least as likely as one
    of the top-k is among them (ties with the k-th aside), so counting there gives the rank over
    the vocabulary; the position's own token may lie below the top-k, hence its device rank.
    """
    text: dict[int, str] = {}

    def decoded(token: int) -> str | None:
        if decode is None:
            return None
        if token not in text:
            text[token] = decode(token)
        return text[token]

    out = []
    for entry, token, rank in zip(entries, tokens, ranks, strict=True):
        out.append({t: Logprob(v, rank if t == token else sum(u >= v for u in entry.values()), decoded(t))
                    for t, v in entry.items()})
    return out
