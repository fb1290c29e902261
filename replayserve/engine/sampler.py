"""Turns the logits of the sequences that sample this step into tokens and log-probabilities."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from replayserve.engine.request import SamplingParams
from replayserve.spec.acceptance import accept_argmax, greedy_accept, rejection_accept


@dataclass(frozen=True)
class SampleResult:
    """The tokens one sequence emits this step: one, or for a speculative verify the accepted
    drafts and the bonus token; with each token's log-probabilities when asked."""

    tokens: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...] | None  # per token: the sampled token's and the top-k

    @property
    def token(self) -> int:
        return self.tokens[-1]


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """(V,) logits -> temperature-scaled logits with top-k / top-p cut to -inf."""
    logits = logits / params.temperature
    if params.top_k != -1 and params.top_k < logits.numel():
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -torch.inf)
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop = probs.cumsum(-1) - probs >= params.top_p
        logits = logits.scatter(0, order[drop], -torch.inf)
    return logits


def sample(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[SampleResult]:
    """logits (S, V) in the compute dtype; one SamplingParams and generator (or None) per row.

    Reported log-probabilities are those of the model's distribution, before temperature and
    truncation.
    """
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(-1)
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        if p.greedy:
            continue
        probs = _filter(logits[row], p).softmax(-1)
        tokens[row] = torch.multinomial(probs, 1, generator=gen)[0]
    k_max = max((p.logprobs or 0) for p in params)
    top = logprobs.topk(k_max, dim=-1) if k_max else None
    tokens_host = tokens.tolist()
    chosen = logprobs.gather(1, tokens[:, None])[:, 0].tolist()
    top_ids = top.indices.tolist() if top is not None else None
    top_vals = top.values.tolist() if top is not None else None
    results = []
    for row, p in enumerate(params):
        lp = None
        if p.logprobs is not None:
            lp = {tokens_host[row]: chosen[row]}
            if top_ids is not None and top_vals is not None:
                lp.update(zip(top_ids[row][: p.logprobs], top_vals[row][: p.logprobs], strict=True))
        results.append(SampleResult((tokens_host[row],), None if lp is None else (lp,)))
    return results


def sample_verify(logits: torch.Tensor, drafts: tuple[int, ...], params: SamplingParams,
                  generator: torch.Generator | None, argmax: list[int] | None = None) -> SampleResult:
    """One verify row: logits (1 + k, V) for the positions after the last known token and after
    each draft. Greedy: the drafts that match the argmax, then the argmax at the first mismatch.
    Otherwise lossless rejection sampling against the filtered target distribution (the drafts
    are deterministic, so their distribution is one-hot). ``argmax``: the rows' argmaxes, when the
    caller has them on the host already (greedy only)."""
    if params.greedy:
        tokens = greedy_accept(logits, drafts) if argmax is None else accept_argmax(argmax, drafts)
    else:
        probs = torch.stack([_filter(row, params).softmax(-1) for row in logits])
        tokens = rejection_accept(probs, drafts, None, generator)
    lps = None
    if params.logprobs is not None:
        logprobs = torch.log_softmax(logits[: len(tokens)], dim=-1)
        lps = []
        for i, token in enumerate(tokens):
            lp = {token: logprobs[i, token].item()}
            if params.logprobs:
                top = logprobs[i].topk(params.logprobs)
                lp.update(zip(top.indices.tolist(), top.values.tolist(), strict=True))
            lps.append(lp)
    return SampleResult(tuple(tokens), None if lps is None else tuple(lps))
