"""`SamplingParams.prompt_logprobs`: the log-probability of each prompt token given its prefix,
scored from the hidden states a prefill chunk computes anyway.

A chunk's position p predicts the prompt token at p + 1, so a chunk of a prompt scores the
prompt tokens after each of its positions (the last position's target is the next chunk's first
token; the prompt's last position predicts the first output token and is the sampler's). Positions
that a prefix-cache hit skips are never computed, so a request that still needs prompt
log-probabilities is admitted without a hit (`Scheduler`), as vLLM does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from replayserve.config import SCORE_ROWS
from replayserve.engine.sampler import compute_dtype, token_ranks
from replayserve.transfer import to_device


@dataclass(frozen=True)
class PromptScores:
    """One chunk's prompt log-probabilities: per scored position, {token id: log-probability} of
    the prompt token it predicts and of the top-k (that token first), and that token's rank."""

    logprobs: tuple[dict[int, float], ...]
    ranks: tuple[int, ...]


def score_prompt(hidden: torch.Tensor, targets: Sequence[int], k: int,
                 compute_logits: Callable[[torch.Tensor], torch.Tensor]) -> PromptScores:
    """Scores prompt tokens from the final hidden states of the positions before them.

    Args:
        hidden: (R, D), model dtype: the hidden states of R consecutive positions.
        targets: R token ids; targets[i] is the token after position i.
        k: how many of the most likely tokens to report besides the target (0: only it).
        compute_logits: the model's LM head, (R', D) -> (R', V).

    Returns:
        The log-probabilities in the sampler's compute dtype (float64 for a float64 model, else
        float32), one device-to-host transfer per `SCORE_ROWS` positions.
    """
    logprobs: list[dict[int, float]] = []
    ranks: list[int] = []
    for start in range(0, len(targets), SCORE_ROWS):
        rows = hidden[start : start + SCORE_ROWS]
        want = to_device(torch.tensor(targets[start : start + SCORE_ROWS], dtype=torch.int64), hidden.device)
        logits = compute_logits(rows)
        lp = torch.log_softmax(logits.to(compute_dtype(logits.dtype)), dim=-1)
        chosen = lp.gather(-1, want[:, None])
        parts = [chosen, token_ranks(lp, chosen)]
        if k:
            top = lp.topk(k, dim=-1)
            parts += [top.indices, top.values]
        # float64 holds token ids exactly and float32 log-probabilities exactly.
        host = torch.cat([p.reshape(-1).to(torch.float64) for p in parts]).tolist()
        n = rows.shape[0]
        top_ids, top_vals = host[2 * n : (2 + k) * n], host[(2 + k) * n :]
        for i, target in enumerate(targets[start : start + n]):
            entry = {target: host[i]}
            entry.update(zip(map(int, top_ids[i * k : (i + 1) * k]), top_vals[i * k : (i + 1) * k], strict=True))
            logprobs.append(entry)
            ranks.append(int(host[n + i]))
    return PromptScores(tuple(logprobs), tuple(ranks))
