"""A benchmark proposer for random weights: the MTP layers run for real, their drafts are replaced
by the target's known greedy path, each draft corrupted with a set probability.

Random MTP weights draft tokens the target almost never accepts, so a benchmark of MTP on a
random model would time verify steps that keep one token. `ControlledMTPProposer` keeps the MTP
layers' cost (it calls the wrapped `MTPProposer.propose_batch` every step, on the same rows) and
sets the acceptance as `OracleProposer` does for free drafts: a draft at output index i of a prompt
is the greedy token there, or (with probability 1 - acceptance, drawn once per (seed, prompt, i))
another token. Verification is unchanged, so outputs stay the target's greedy tokens.

Not a serving option: benchmarks and tests put it in place of an engine's MTP proposer
(`engine.proposer = ControlledMTPProposer(engine.proposer, paths, 0.9)`), one engine per instance.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from replayserve.speculative.mtp import MTPProposer
from replayserve.speculative.proposers import DraftRequest, Proposer


class ControlledMTPProposer(Proposer):
    """`mtp`'s cost, the greedy path's drafts at a per-draft acceptance of `acceptance`.

    A request whose prompt has no known path, or whose outputs have left it (a float tie flipped
    the greedy token), keeps the MTP layers' own drafts.
    """

    def __init__(self, mtp: MTPProposer, paths: Mapping[tuple[int, ...], Sequence[int]], acceptance: float,
                 seed: int = 0) -> None:
        """paths: prompt token ids -> the greedy output tokens that follow it (spec off)."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"ControlledMTPProposer acceptance must be in [0, 1], got {acceptance}")
        self.mtp, self.acceptance, self.seed = mtp, acceptance, seed
        vocab = mtp.model.config.vocab_size
        # Drafts and paths are worked out once: per step the host only slices lists.
        self.paths = {tuple(p): list(c) for p, c in paths.items()}
        self.drafts = {p: self._corrupt(p, c, vocab) for p, c in self.paths.items()}
        self._lengths = sorted({len(p) for p in self.paths}, reverse=True)
        self._prompts: dict[str, tuple[int, ...] | None] = {}  # request id -> its known prompt

    def _corrupt(self, prompt: tuple[int, ...], path: list[int], vocab: int) -> list[int]:
        """The path with each token replaced, with probability 1 - acceptance, by another one."""
        # hashlib, not hash(): Python salts str hashes per process; runs must agree across processes.
        key = hashlib.sha256(f"{self.seed}|{','.join(map(str, prompt))}".encode()).digest()
        gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
        n = len(path)
        corrupted = torch.rand(n, generator=gen, dtype=torch.float64) >= self.acceptance
        offset = torch.randint(1, vocab, (n,), generator=gen)  # in [1, V - 1]: always another token
        tokens = torch.tensor(path, dtype=torch.int64)
        return torch.where(corrupted, (tokens + offset) % vocab, tokens).tolist()

    def is_corrupted(self, prompt: Sequence[int], index: int) -> bool:
        """Whether the draft at output index `index` of `prompt` differs from the greedy token."""
        key = tuple(prompt)
        return self.drafts[key][index] != self.paths[key][index]

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return []  # the MTP layers need the request's hidden states: see propose_batch

    def _prompt(self, request: DraftRequest) -> tuple[int, ...] | None:
        if request.request_id not in self._prompts:
            tokens = tuple(request.token_ids)
            self._prompts[request.request_id] = next(
                (tokens[:n] for n in self._lengths if n <= len(tokens) and tokens[:n] in self.paths), None)
        return self._prompts[request.request_id]

    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """The MTP layers' drafts for every row (computed, so timed), then each row on its greedy
        path takes the path's drafts instead, as many as its room (the MTP's own fill the rest
        where the path ends)."""
        proposed = self.mtp.propose_batch(requests)
        for r in requests:
            prompt = self._prompt(r)
            if prompt is None:
                continue
            pos = len(r.token_ids) - len(prompt)
            if list(r.token_ids[len(prompt):]) != self.paths[prompt][:pos]:
                continue
            own = proposed.get(r.request_id, ())
            path = tuple(self.drafts[prompt][pos : pos + r.room])
            proposed[r.request_id] = path + tuple(own[len(path) : r.room])
        return proposed
