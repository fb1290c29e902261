"""The checkpoint's MTP layers (Nemotron-H's `NemotronHMTP`, the Qwen families' `QwenMTP`) as proposer:
drafts from the target's own final hidden states."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.speculative.mtp_drafts import greedy_drafts
from replayserve.speculative.mtp_graphs import DraftGraphs
from replayserve.speculative.proposers import DraftRequest, Proposer


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
    over the last `window` recorded positions each call (no cache across calls, so it never has to
    follow the target's rollbacks or prefix hits; a hit only shortens what it sees). Drafts do not
    change outputs: verification keeps them lossless.

    `propose_batch` (what the engine calls) runs all requests of a step as one padded batch on the
    device (`greedy_drafts`: the MTP attention's keys and values kept between a call's drafts, so
    draft j + 1 computes one position per request, and no host read until the drafts are made);
    `propose_request` is its plain reference, one request at a time.

    fixed_shapes: pad every call's windows to `window` positions, so the draft loop's shapes
    depend only on the rows and drafts (what a CUDA graph of it needs) rather than on the longest
    context; None: on CUDA. Off, a batch of short contexts computes less.
    draft_graphs: replays the loop from CUDA graphs (`mtp_graphs.DraftGraphs` of this window);
    None (the default) runs it eagerly.
    """

    def __init__(self, model: nn.Module, store: HiddenStore, window: int = 256,
                 fixed_shapes: bool | None = None, draft_graphs: DraftGraphs | None = None) -> None:
        if not hasattr(model, "mtp"):
            raise ValueError("the model has no MTP layers (num_nextn_predict_layers = 0)")
        if window < 1:
            raise ValueError(f"MTPProposer window must be >= 1 position, got {window}")
        if draft_graphs is not None and (draft_graphs.width != window or fixed_shapes is False):
            raise ValueError(f"MTP draft graphs run fixed shapes of the proposer's window ({window} positions); "
                             f"got graphs of width {draft_graphs.width} and fixed_shapes={fixed_shapes}")
        self.model, self.store, self.window, self.fixed_shapes = model, store, window, fixed_shapes
        self.draft_graphs = draft_graphs

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return []  # needs the request's hidden states: see propose_request

    def _inputs(self, request_id: str, token_ids: Sequence[int]) -> tuple[torch.Tensor, Sequence[int]] | None:
        """The recorded hidden states (n, hidden) of the last up to `window` computed positions
        and the n tokens each predicted (the MTP's embedding input); None without a recorded run
        that reaches the last computed position."""
        run = self.store.runs.get(request_id)
        last = len(token_ids) - 2  # the last computed position: its hidden state predicted token L-1
        if run is None or not run[0] <= last < run[0] + run[1].shape[0]:
            return None
        first = max(run[0], last - self.window + 1)
        return run[1][first - run[0] : last - run[0] + 1], token_ids[first + 1 :]

    @torch.inference_mode()
    def propose_request(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        inputs = self._inputs(request_id, token_ids)
        if inputs is None or k <= 0:
            return []
        hidden, tokens = inputs
        embed = self.model.backbone.embeddings
        embeds = embed(torch.tensor(tokens, device=hidden.device))
        drafts: list[int] = []
        for _ in range(k):
            out = self.model.mtp(embeds, hidden, last_only=True)
            token = int(self.model.compute_logits(out[-1:]).argmax(-1))
            drafts.append(token)
            embeds = torch.cat([embeds, embed(torch.tensor([token], device=hidden.device))])
            hidden = torch.cat([hidden, out[-1:]])
        return drafts

    def pack_windows(self, rows: Sequence[tuple[Sequence[int], torch.Tensor]],
                     width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows' windows (`_inputs`: tokens, hidden states) left-padded to `width` >= the longest:
        hidden (B, width, hidden), ids (B, width) int64 and valid (B, width) bool, on the device."""
        device = rows[0][1].device
        hidden = torch.stack([F.pad(h, (0, 0, width - h.shape[0], 0)) for _, h in rows])
        # Padding ids are any valid token: their positions are masked out of every real row.
        ids = torch.tensor([[0] * (width - len(tokens)) + list(tokens) for tokens, _ in rows]).to(device)
        lengths = torch.tensor([len(tokens) for tokens, _ in rows]).to(device)
        valid = torch.arange(width, device=device) >= width - lengths[:, None]
        return hidden, ids, valid

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """The drafts `propose_request` gives each request, for all of them at once: the windows
        left-padded into (B, W) (W the window with `fixed_shapes` or `draft_graphs`, else the
        longest row's), then `greedy_drafts` on the device (replayed from `draft_graphs` when
        set), read back once. Rows run the largest room and are cut to their own."""
        drafts: dict[str, tuple[int, ...]] = {r.request_id: () for r in requests}
        rows = [(r, inputs) for r in requests if r.room > 0
                and (inputs := self._inputs(r.request_id, r.token_ids)) is not None]
        if not rows:
            return drafts
        windows = [(tokens, hidden) for _, (hidden, tokens) in rows]
        fixed = self.fixed_shapes if self.fixed_shapes is not None else windows[0][1].device.type == "cuda"
        width = self.window if fixed or self.draft_graphs is not None else max(h.shape[0] for _, h in windows)
        inputs = self.pack_windows(windows, width)
        k = max(r.room for r, _ in rows)
        table = greedy_drafts(self.model, *inputs, k) if self.draft_graphs is None else self.draft_graphs(*inputs, k)
        for (r, _), row in zip(rows, table.tolist(), strict=True):  # the one host sync
            drafts[r.request_id] = tuple(row[: r.room])
        return drafts
