"""Nemotron-H MTP layers as proposer: drafts from the target's own final hidden states."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replayserve.models.nemotron_h import NemotronHForCausalLM
from replayserve.speculative.proposers import Proposer


class HiddenStore:
    """Each request's final hidden states (after norm_f) for a contiguous run of its positions,
    recorded by the runner after every step: the MTP layers' second input."""

    def __init__(self) -> None:
        self.runs: dict[str, tuple[int, torch.Tensor]] = {}

    def record(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Positions start .. start + len(hidden) - 1, replacing what was stored from `start` on
        (a recompute after preemption, rows past a rejected draft)."""
        run = self.runs.get(request_id)
        if run is not None and run[0] <= start <= run[0] + run[1].shape[0]:
            hidden = torch.cat([run[1][: start - run[0]], hidden])
            start = run[0]
        self.runs[request_id] = (start, hidden)

    def forget(self, request_id: str) -> None:
        self.runs.pop(request_id, None)


class MTPProposer(Proposer):
    """Greedy drafts from the checkpoint's MTP block stack (`mtp.layers.*`).

    Draft 1 is the MTP head at the last computed position p, fed the target's hidden state at p
    and the embedding of the token sampled from it; draft j + 1 feeds the MTP's own output for
    draft j, as public engines chain one MTP layer for k drafts. The MTP attention runs causally
    over the last `window` recorded positions each call (no cache of its own, so it never has to
    follow the target's rollbacks or prefix hits; a hit only shortens what it sees). Drafts do not
    change outputs: verification keeps them lossless.
    """

    def __init__(self, model: NemotronHForCausalLM, store: HiddenStore, window: int = 256) -> None:
        if not hasattr(model, "mtp"):
            raise ValueError("the model has no MTP layers (num_nextn_predict_layers = 0)")
        self.model, self.store, self.window = model, store, window

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return []  # needs the request's hidden states: see propose_request

    @torch.inference_mode()
    def propose_request(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        run = self.store.runs.get(request_id)
        last = len(token_ids) - 2  # the last computed position: its hidden state predicted token L-1
        if run is None or k <= 0 or not run[0] <= last < run[0] + run[1].shape[0]:
            return []
        first = max(run[0], last - self.window + 1)
        hidden = run[1][first - run[0] : last - run[0] + 1]
        embed = self.model.backbone.embeddings
        ids = torch.tensor(token_ids[first + 1 :], device=hidden.device)
        embeds = embed(ids)
        drafts: list[int] = []
        for _ in range(k):
            out = self.model.mtp(embeds, hidden, last_only=True)
            token = int(self.model.compute_logits(out[-1:]).argmax(-1))
            drafts.append(token)
            embeds = torch.cat([embeds, embed(torch.tensor([token], device=hidden.device))])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts
