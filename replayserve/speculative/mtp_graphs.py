"""The MTP draft loop (`greedy_drafts`) as CUDA graphs: one per (row bucket, drafts) at the
proposer's draft-call width (max_drafts + 1 new positions per row), over persistent input buffers
and the proposer's MTP cache. Off by default: `MTPProposer(draft_graphs=True)` builds it over its
own cache (a benchmark switch until it is measured); eager drafts are the reference.

A call's rows are copied into the bucket's buffers; rows past them are made padding rows (no real
position, the cache's scratch row), so they write nothing a real row reads and compute finite
drafts nobody reads. Rows are independent in the loop (attention stays within a row, the MLP and
MoE are per position), so padding rows never change real ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from replayserve.models.mtp_kv import MTPKV, MTPCall
from replayserve.speculative.mtp_drafts import greedy_drafts

logger = logging.getLogger(__name__)


def row_buckets(max_rows: int) -> tuple[int, ...]:
    """Row counts with a graph: powers of two up to max_rows, and max_rows itself."""
    sizes = {1 << i for i in range(max_rows.bit_length()) if 1 << i <= max_rows}
    sizes.add(max_rows)
    return tuple(sorted(sizes))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    drafts: torch.Tensor  # (bucket, k) int64: the graph's output, rewritten by every replay


class DraftGraphs:
    """`greedy_drafts` of up to `max_rows` rows of `width` new positions against `kv` (the
    proposer's cache), replayed from CUDA graphs.

    The MoE layers of the MTP stack must take their sync-free Triton path (float32, bfloat16 or
    float16 on CUDA): the reference expert loop reads its routing on the host, which a capture
    cannot hold.
    """

    def __init__(self, model: nn.Module, kv: MTPKV, width: int, max_rows: int) -> None:
        weight = model.backbone.embeddings.weight
        if weight.device.type != "cuda":
            raise ValueError(f"MTP draft graphs need a CUDA model, got one on {weight.device}")
        self.model, self.kv, self.width = model, kv, width
        self.buckets = row_buckets(max_rows)
        rows, device = self.buckets[-1], weight.device
        self.hidden = torch.zeros(rows, width, model.config.hidden_size, dtype=weight.dtype, device=device)
        self.ids = torch.zeros(rows, width, dtype=torch.int64, device=device)
        # end, count, lo, cache row per row; padding rows: no real position, the scratch row.
        self.call = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self._padding = torch.tensor([0, 0, 0, kv.scratch], dtype=torch.int64, device=device)[:, None]
        self.call.copy_(self._padding.expand_as(self.call))
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None

    def bucket(self, rows: int) -> int | None:
        """The smallest bucket holding `rows` rows; None: more than max_rows (run eagerly)."""
        return next((b for b in self.buckets if b >= rows), None)

    def capture_all(self, max_drafts: int) -> None:
        """Every bucket's graph for 1..max_drafts drafts, before serving (each capture runs the
        loop once first, compiling its kernels; on padding rows alone, so the cache is unchanged)."""
        for bucket in self.buckets:
            for k in range(1, max_drafts + 1):
                self._graph(bucket, k)

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, call: torch.Tensor, num_drafts: int) -> torch.Tensor:
        """`greedy_drafts(model, kv, hidden, ids, MTPCall(*call), num_drafts)` for (B, width)
        inputs and the (4, B) int64 call table (`MTPProposer.pack`'s): (B, k) int64, valid until
        the next call."""
        rows = hidden.shape[0]
        bucket = self.bucket(rows)
        if bucket is None or hidden.shape[1] != self.width:
            return greedy_drafts(self.model, self.kv, hidden, ids, MTPCall(*call), num_drafts)
        entry = self._graph(bucket, num_drafts)  # before the inputs: a capture resets them
        self.hidden[:rows].copy_(hidden)
        self.ids[:rows].copy_(ids)
        self.call[:, :rows].copy_(call)
        self.call[:, rows:bucket].copy_(self._padding.expand(-1, bucket - rows))
        entry.graph.replay()
        return entry.drafts[:rows]

    def _graph(self, bucket: int, num_drafts: int) -> _Graph:
        key = (bucket, num_drafts)
        if key not in self.graphs:
            self.call[:, :bucket].copy_(self._padding.expand(-1, bucket))  # the warm-up writes scratch only
            inputs = (self.kv, self.hidden[:bucket], self.ids[:bucket], MTPCall(*self.call[:, :bucket]))
            # Triton kernels compile on their first call, which a capture cannot hold: run the
            # loop once on a side stream first.
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                greedy_drafts(self.model, *inputs, num_drafts)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                drafts = greedy_drafts(self.model, *inputs, num_drafts)
            self._pool = graph.pool()
            self.graphs[key] = _Graph(graph, drafts)
            logger.debug("captured the MTP draft graph of %d rows, %d drafts", bucket, num_drafts)
        return self.graphs[key]
