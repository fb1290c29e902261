"""Draft proposers: cheap guesses at the tokens a request will generate next."""

from __future__ import annotations

import hashlib
import random
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch


class DraftRequest(NamedTuple):
    """A running request that may take drafts this step: its known tokens and how many drafts the
    step has room for (>= 1)."""

    request_id: str
    token_ids: Sequence[int]
    room: int


class Proposer(ABC):
    """Proposes up to k draft tokens to follow a request's known tokens (prompt + outputs)."""

    @abstractmethod
    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """At most k tokens (possibly fewer, possibly none).

        Deterministic proposers: the draft distribution is one-hot on each proposed token.
        """

    def propose_request(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """As `propose`, for proposers that keep per-request inputs (MTP: hidden states)."""
        return self.propose(token_ids, k)

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """Drafts for every request of a step: request_id -> at most its `room` tokens. One call a
        step, so proposers that run a model (MTP) batch the requests; the rest loop."""
        return {r.request_id: tuple(self.propose_request(r.request_id, r.token_ids, r.room))[: r.room]
                for r in requests}


class NgramProposer(Proposer):
    """Prompt-lookup decoding: match the last n tokens (n from max_n down to min_n) against an earlier
    occurrence in token_ids (the most recent one that is not the suffix itself) and propose the up to k
    tokens that followed it."""

    def __init__(self, min_n: int = 1, max_n: int = 3) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"NgramProposer needs 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The up to k tokens that followed the most recent earlier occurrence of the longest matching suffix."""
        length = len(token_ids)
        if k <= 0 or length < self.min_n + 1:
            return []
        # One vectorised comparison per n keeps a call O(L * max_n) in C rather than a Python scan.
        tokens = torch.as_tensor(token_ids, dtype=torch.long)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # Windows of tokens[:-1] start at 0..L-1-n, i.e. every occurrence except the suffix itself.
            windows = tokens[:-1].unfold(0, n, 1)
            hits = (windows == tokens[length - n :]).all(dim=1).nonzero()
            if hits.numel():
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []


class OracleProposer(Proposer):
    """Test proposer: the target model's own greedy continuation of each known prompt, with each
    position independently corrupted with probability `corrupt_prob` (deterministically, from
    (seed, prompt, absolute position)), so tests can drive acceptance from 0% to 100% and predict it."""

    def __init__(
        self,
        continuations: Mapping[tuple[int, ...], Sequence[int]],
        corrupt_prob: float,
        vocab_size: int,
        seed: int = 0,
    ) -> None:
        """continuations: prompt token ids -> the greedy output tokens that follow it (as far as known)."""
        if not 0.0 <= corrupt_prob <= 1.0:
            raise ValueError(f"OracleProposer corrupt_prob must be in [0, 1], got {corrupt_prob}")
        if vocab_size < 2:
            raise ValueError(
                f"OracleProposer vocab_size must be >= 2 so a corrupted token can differ, got {vocab_size}"
            )
        self.continuations = {tuple(p): list(c) for p, c in continuations.items()}
        self.corrupt_prob = corrupt_prob
        self.vocab_size = vocab_size
        self.seed = seed
        # Longest first, so the first length whose prefix is a key gives the longest matching prompt.
        self._prompt_lengths = sorted({len(p) for p in self.continuations}, reverse=True)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """The next up to k continuation tokens of the longest known prompt that prefixes token_ids."""
        tokens = tuple(token_ids)
        prompt = self._longest_prompt(tokens)
        if prompt is None or k <= 0:
            return []
        continuation = self.continuations[prompt]
        pos = len(tokens) - len(prompt)
        # The oracle only knows the greedy path; once the outputs leave it there is nothing to propose.
        if list(tokens[len(prompt) :]) != continuation[:pos]:
            return []
        drafts = []
        for j, token in enumerate(continuation[pos : pos + k], start=pos):
            rng = self._rng(prompt, j)
            if rng.random() < self.corrupt_prob:
                # An offset in [1, V-1] always lands on a different token.
                token = (token + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
            drafts.append(token)
        return drafts

    def is_corrupted(self, prompt: Sequence[int], index: int) -> bool:
        """Whether propose() replaces continuation[index] of `prompt` with a different token."""
        return self._rng(tuple(prompt), index).random() < self.corrupt_prob

    def _longest_prompt(self, tokens: tuple[int, ...]) -> tuple[int, ...] | None:
        for n in self._prompt_lengths:
            if n <= len(tokens) and tokens[:n] in self.continuations:
                return tokens[:n]
        return None

    def _rng(self, prompt: tuple[int, ...], index: int) -> random.Random:
        # hashlib, not hash(): Python salts str hashes per process, and tests compare across instances.
        key = f"{self.seed}|{','.join(map(str, prompt))}|{index}".encode()
        return random.Random(int.from_bytes(hashlib.sha256(key).digest()[:8], "little"))
