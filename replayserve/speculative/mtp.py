"""The checkpoint's MTP layers (Nemotron-H's `NemotronHMTP`, the Qwen families' `QwenMTP`) as proposer:
drafts from the target's own final hidden states."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from replayserve.models.mtp_kv import MTPKV, MTPCall
from replayserve.speculative.mtp_cache import CacheRows
from replayserve.speculative.mtp_drafts import greedy_drafts
from replayserve.speculative.mtp_graphs import DraftGraphs
from replayserve.speculative.proposers import DraftRequest, Proposer
from replayserve.transfer import to_device


class HiddenStore:
    """Each request's final hidden states (after norm_f) for a contiguous run of its positions,
    recorded by the runner after every step: the MTP layers' second input.

    keep: the most positions kept per request (the oldest dropped: the MTP attention sees only the
    last `mtp_window`, and the MTP cache holds what it already ran), so recording a step copies
    O(keep) rather than the whole context; None: all."""

    def __init__(self, keep: int | None = None) -> None:
        self.keep = keep
        self.runs: dict[str, tuple[int, torch.Tensor]] = {}
        self.rewrites: dict[str, int] = {}  # request id -> the first position recorded again

    def record(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """Positions start .. start + len(hidden) - 1, replacing what was stored from `start` on
        (a recompute after preemption, rows past a rejected draft)."""
        run = self.runs.get(request_id)
        # What the MTP cache built from earlier records no longer holds: from a re-recorded
        # position on, everything when the run starts afresh.
        stale = 0 if run is None else start if start < run[0] + run[1].shape[0] else None
        if stale is not None:
            self.rewrites[request_id] = min(stale, self.rewrites.get(request_id, stale))
        if run is not None and run[0] <= start <= run[0] + run[1].shape[0]:
            hidden = torch.cat([run[1][: start - run[0]], hidden])
            start = run[0]
        if self.keep is not None and hidden.shape[0] > self.keep:  # a view: the next record copies `keep`
            start, hidden = start + hidden.shape[0] - self.keep, hidden[-self.keep :]
        self.runs[request_id] = (start, hidden)

    def take_rewrite(self, request_id: str) -> int | None:
        """The first position recorded again (or afresh) since the last call, for the one MTP
        proposer that reads this store; None: only new positions were recorded."""
        return self.rewrites.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.runs.pop(request_id, None)
        self.rewrites.pop(request_id, None)


class MTPProposer(Proposer):
    """Greedy drafts from the checkpoint's MTP block stack (`mtp.layers.*`).

    Draft 1 is the MTP head at the last computed position p, fed the target's hidden state at p
    and the embedding of the token sampled from it; draft j + 1 feeds the MTP's own output for
    draft j, as public engines chain one MTP layer for k drafts. The MTP attention sees the last
    `window` recorded positions (fewer after a prefix hit: none before the recorded run). Drafts do
    not change outputs: verification keeps them lossless.

    `propose_batch` (what the engine calls) keeps the MTP attention's keys and values across calls
    (`models/mtp_kv.MTPKV`, a ring of window + max_drafts positions per row for up to `max_rows`
    requests, rows handed out by `mtp_cache.CacheRows`), so a call runs the MTP layers only on the
    positions recorded since the last (the tokens the last step kept), then the drafts
    (`greedy_drafts`, on the device, read back once). `propose_request` is its plain reference: one
    request at a time over its whole window, no cache.

    fixed_shapes: the draft loop always runs max_drafts + 1 new positions per row (what a CUDA
    graph of it needs); a row with more (after its prompt, or a recompute) first runs the rest in
    a call that only fills the cache. None: on CUDA. Off, one call runs the most any row has.
    draft_graphs: replays the draft loop from CUDA graphs (`enable_draft_graphs`: CUDA, fixed
    shapes); False (the default) runs it eagerly.
    """

    def __init__(self, model: nn.Module, store: HiddenStore, window: int = 256, fixed_shapes: bool | None = None,
                 draft_graphs: bool = False, max_rows: int = 64, max_drafts: int = 4) -> None:
        if not hasattr(model, "mtp"):
            raise ValueError("the model has no MTP layers (num_nextn_predict_layers = 0)")
        if window < 1 or max_rows < 1 or max_drafts < 1:
            raise ValueError(f"MTPProposer needs window, max_rows and max_drafts >= 1, got {window}, {max_rows}, "
                             f"{max_drafts}")
        self.model, self.store, self.window, self.fixed_shapes = model, store, window, fixed_shapes
        self.max_rows, self.max_drafts = max_rows, max_drafts
        self.draft_graphs: DraftGraphs | None = None
        cfg, weight = model.config, model.backbone.embeddings.weight
        ring = window + max_drafts
        self.kv = MTPKV.empty(cfg, max_rows, ring, weight.dtype, weight.device)
        self.rows = CacheRows(max_rows, ring, window)
        if draft_graphs:
            self.enable_draft_graphs()

    def enable_draft_graphs(self) -> DraftGraphs:
        """From now on the draft loop replays CUDA graphs (`mtp_graphs.DraftGraphs`) over this
        proposer's cache, at its fixed width (max_drafts + 1 positions) for up to max_rows rows;
        `capture_all` on the result captures them before serving."""
        if self.fixed_shapes is False:
            raise ValueError("MTPProposer(draft_graphs=True) replays graphs of fixed shapes (max_drafts + 1 = "
                             f"{self.max_drafts + 1} positions per row); it cannot take fixed_shapes=False")
        self.draft_graphs = DraftGraphs(self.model, self.kv, self.max_drafts + 1, self.max_rows)
        return self.draft_graphs

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return []  # needs the request's hidden states: see propose_request

    def _run(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, torch.Tensor] | None:
        """The recorded run (start, hidden states) when it reaches the last computed position."""
        run = self.store.runs.get(request_id)
        last = len(token_ids) - 2  # the last computed position: its hidden state predicted token L-1
        return run if run is not None and run[0] <= last < run[0] + run[1].shape[0] else None

    @torch.inference_mode()
    def propose_request(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        run = self._run(request_id, token_ids)
        if run is None or k <= 0:
            return []
        last = len(token_ids) - 2
        first = max(run[0], last - self.window + 1)
        hidden, tokens = run[1][first - run[0] : last - run[0] + 1], token_ids[first + 1 :]
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

    def pack(self, rows: Sequence[tuple[Sequence[int], tuple[int, torch.Tensor], int, int, int, int]],
             width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows (token ids, recorded run, first and last position to run, lo, cache row) left-padded
        to `width` >= the most positions: hidden (B, width, hidden), ids (B, width) int64 (the token
        each position predicted) and the call table (4, B) int64 (`MTPCall`'s fields: end, count,
        lo, cache row), on the device; ids and the table reach it in one pinned, asynchronous copy."""
        hidden = torch.stack([F.pad(run[1][a - run[0] : b - run[0] + 1], (0, 0, width - (b - a + 1), 0))
                              for _, run, a, b, _, _ in rows])
        # Padding ids are any valid token: their positions are masked out of every real row.
        ids = [v for tokens, _, a, b, _, _ in rows for v in [0] * (width - (b - a + 1)) + list(tokens[a + 1 : b + 2])]
        table = [v for field in zip(*((b, b - a + 1, lo, row) for _, _, a, b, lo, row in rows), strict=True)
                 for v in field]
        packed = to_device(torch.tensor(table + ids, dtype=torch.int64), hidden.device)
        split = 4 * len(rows)
        return hidden, packed[split:].view(len(rows), width), packed[:split].view(4, len(rows))

    @torch.inference_mode()
    def propose_batch(self, requests: Sequence[DraftRequest]) -> dict[str, tuple[int, ...]]:
        """The drafts `propose_request` gives each request, for all of them at once: each row's new
        positions (since its last call) left-padded into (B, T), then `greedy_drafts` on the device
        against the cache (replayed from `draft_graphs` when set), read back once. Rows run the
        largest room and are cut to their own."""
        drafts: dict[str, tuple[int, ...]] = {r.request_id: () for r in requests}
        if any(r.room > self.max_drafts for r in requests):
            raise ValueError(f"MTPProposer drafts at most max_drafts = {self.max_drafts} tokens per row, asked for "
                             f"{max(r.room for r in requests)}")
        self.rows.release_except(self.store.runs)
        if len(self.rows.free) < sum(r.request_id not in self.rows.rows for r in requests):
            # Requests not drafting now (preempted ones) give their rows up: a recompute refills them anyway.
            self.rows.release_except({r.request_id for r in requests})
        rows = []
        for r in requests:
            if r.room > 0 and (run := self._run(r.request_id, r.token_ids)) is not None:
                last = len(r.token_ids) - 2
                plan = self.rows.plan(r.request_id, run[0], last, self.store.take_rewrite(r.request_id))
                if plan is not None:  # no free cache row: no drafts (verification needs none)
                    rows.append((r, run, plan.first, last, plan.lo, plan.row))
        if not rows:
            return drafts
        k = max(r.room for r, *_ in rows)
        fixed = (self.draft_graphs is not None or self.fixed_shapes
                 or self.fixed_shapes is None and rows[0][1][1].device.type == "cuda")
        width = self.max_drafts + 1 if fixed else max(b - a + 1 for _, _, a, b, _, _ in rows)
        behind = [(r.token_ids, run, a, b - width, lo, row) for r, run, a, b, lo, row in rows if b - a + 1 > width]
        if behind:  # positions before the draft call's: into the cache only
            hidden, ids, call = self.pack(behind, max(b - a + 1 for _, _, a, b, _, _ in behind))
            self.model.mtp.forward_cached(self.model.backbone.embeddings(ids), hidden, self.kv, MTPCall(*call),
                                          output=False)
        hidden, ids, call = self.pack([(r.token_ids, run, max(a, b - width + 1), b, lo, row)
                                       for r, run, a, b, lo, row in rows], width)
        table = (greedy_drafts(self.model, self.kv, hidden, ids, MTPCall(*call), k) if self.draft_graphs is None
                 else self.draft_graphs(hidden, ids, call, k))
        for (r, *_), row in zip(rows, table.tolist(), strict=True):  # the one host sync
            drafts[r.request_id] = tuple(row[: r.room])
            self.rows.commit(r.request_id, len(r.token_ids) - 2, k)
        return drafts
