"""Logits penalties that depend on a request's tokens so far, and the min_tokens ban, applied to a
step's logits before sampling (greedy rows included, as in vLLM).

For a row with output tokens o and prompt tokens q, on the raw logits x:
- repetition_penalty r (1 = off): for every token in q or o, x / r where x > 0, x * r elsewhere,
  clamped to the dtype's finite range (a small r overflows x / r to inf, and the sampler's
  x - max(x) then gives inf - inf = NaN probabilities);
- frequency_penalty f: x - f * count of the token in o;
- presence_penalty p: x - p for every token that occurs in o;
- min_tokens m: while len(o) < m, the stop token ids and (unless ignore_eos) EOS are -inf.
Rows that need none of them cost nothing; the others bring their token lists to the device once
per step (one copy for all of them). Such rows take no speculative drafts (the scheduler skips
them), so each has one position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from replayserve.sampling_params import SamplingParams
from replayserve.transfer import to_device


def uses_history(p: SamplingParams) -> bool:
    """The row's logits depend on its tokens so far."""
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.min_tokens > 0


@dataclass(frozen=True)
class Penalties:
    """The device tensors of one step's penalized rows (P of them, at positions `rows`)."""

    rows: torch.Tensor  # (P,) int64 positions in the step's logits
    repetition: torch.Tensor  # (P, 1) compute dtype
    frequency: torch.Tensor  # (P, 1)
    presence: torch.Tensor  # (P, 1)
    output_counts: torch.Tensor  # (P, V) compute dtype: occurrences in the output
    seen: torch.Tensor  # (P, V) bool: in the prompt or the output
    banned: torch.Tensor  # (P, V) bool: stop ids masked by min_tokens

    @classmethod
    def build(cls, params: Sequence[SamplingParams], positions: Sequence[int],
              histories: Sequence[tuple[Sequence[int], Sequence[int]]], eos_token_ids: Sequence[int],
              vocab_size: int, dtype: torch.dtype, device: torch.device) -> Penalties | None:
        """params, positions (each row's position) and (prompt, output) token lists per row; None
        when no row uses a penalty or min_tokens."""
        chosen = [i for i, p in enumerate(params) if uses_history(p)]
        if not chosen:
            return None
        scalars, index = [], [[], [], []]  # index: (kind, row, token); kind 0 output, 1 prompt, 2 banned
        for row, i in enumerate(chosen):
            p, (prompt, output) = params[i], histories[i]
            scalars.append([p.repetition_penalty, p.frequency_penalty, p.presence_penalty])
            groups = [output, prompt if p.repetition_penalty != 1.0 else ()]
            if len(output) < p.min_tokens:
                groups.append([*p.stop_token_ids, *(() if p.ignore_eos else eos_token_ids)])
            for kind, tokens in enumerate(groups):
                index[0] += [kind] * len(tokens)
                index[1] += [row] * len(tokens)
                index[2] += tokens
        values = to_device(torch.tensor(scalars, dtype=dtype), device)
        kind, row, token = to_device(torch.tensor(index, dtype=torch.int64).reshape(3, -1), device)
        counts = torch.zeros(3, len(chosen), vocab_size, dtype=dtype, device=device)
        counts.index_put_((kind, row, token), torch.ones_like(token, dtype=dtype), accumulate=True)
        return cls(rows=to_device(torch.tensor([positions[i] for i in chosen]), device),
                   repetition=values[:, 0:1], frequency=values[:, 1:2], presence=values[:, 2:3],
                   output_counts=counts[0], seen=(counts[0] + counts[1]) > 0, banned=counts[2] > 0)


def apply_penalties(logits: torch.Tensor, penalties: Penalties) -> torch.Tensor:
    """logits (N, V) -> a copy in the penalties' dtype with the penalized rows changed."""
    x = logits.to(penalties.repetition.dtype).clone()
    rows = x[penalties.rows]
    r = penalties.repetition
    largest = torch.finfo(x.dtype).max
    repeated = torch.where(rows > 0, rows / r, rows * r).clamp(-largest, largest)
    rows = torch.where(penalties.seen, repeated, rows)
    rows = rows - penalties.frequency * penalties.output_counts - penalties.presence * (penalties.output_counts > 0)
    x[penalties.rows] = rows.masked_fill(penalties.banned, -torch.inf)
    return x


def apply_penalties_ref(logits: torch.Tensor, params: SamplingParams, prompt: Sequence[int],
                        output: Sequence[int], eos_token_ids: Sequence[int]) -> torch.Tensor:
    """The oracle of `apply_penalties` for one row, token by token: (V,) -> (V,)."""
    x = logits.clone()
    for token in set(prompt) | set(output) if params.repetition_penalty != 1.0 else ():
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token in set(output):
        x[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    if len(output) < params.min_tokens:
        for token in (*params.stop_token_ids, *(() if params.ignore_eos else eos_token_ids)):
            x[token] = -torch.inf
    return x
