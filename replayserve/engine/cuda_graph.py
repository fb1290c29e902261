"""CUDA graphs of the decode step: persistent input buffers and one graph per padded batch size
and row width.

A decode-only step (every row a decode token, or a speculative verify of 1 + drafts tokens) is
padded to the smallest capture bucket that holds its rows, and every row to the step's width W
(1, or 1 + k when any row verifies drafts). Padded rows and tokens point at a pad KV block and
a pad Mamba state slot that no request owns, so whatever they compute lands where nothing reads
it; each row's real token count travels with it. The step's inputs are written into one of two
pinned host buffers, used in turn (with async scheduling the next step is loaded while this
one's copy may still wait behind the running step), and reach the device in one non-blocking
copy. A plain decode step planned before the previous step's tokens reached the host (async
scheduling) takes its input ids from those tokens on the device (`StepPlan.fed_rows`). The
graph of (bucket, W) then replays
the forward the runner gives it: the SSM backend's `begin_step`, the model and the logits of
every token, and for plain decode (W = 1, every row keeps its one token) the `end_step`. Slot
resets and copies before it, and sampling, a verify's `end_step` and publishing after it, stay
eager in the runner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from replayserve.engine.scheduler import StepPlan
from replayserve.layers.step_context import StepContext

logger = logging.getLogger(__name__)

# The forward of a step: (input_ids (T,), context) -> (hidden (T, D), logits (T, V)).
Forward = Callable[[torch.Tensor, StepContext], tuple[torch.Tensor, torch.Tensor]]


def capture_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph: 1, 2, 4, 8, then multiples of 16, and max_num_seqs itself."""
    sizes = {b for b in (1, 2, 4, 8) if b <= max_num_seqs}
    sizes.update(range(16, max_num_seqs + 1, 16))
    sizes.add(max_num_seqs)
    return tuple(sorted(sizes))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # (bucket * W, D): the graph's outputs, rewritten by every replay
    logits: torch.Tensor  # (bucket * W, V)
    state: Any  # what the forward left on Python objects (see `DecodeGraphs.keep`)
    # The context's own tensors (query_start_loc, positions) were allocated outside the graph's
    # pool: the replays read their memory, so the graph keeps them alive.
    context: StepContext


class DecodeGraphs:
    """Graphs of the decode forward for each (bucket, width), over one set of persistent buffers.

    max_width: 1 + k with speculation. pad_block: a KV block outside the pool; pad_slot: a
    Mamba state slot outside the pools. keep / restore: the forward may leave per-step state on
    Python objects (the SSM backend's verify windows); `keep` reads it after the capture and
    `restore` puts it back after each replay, since a replay runs no Python.
    """

    def __init__(self, forward: Forward, max_num_seqs: int, max_width: int, blocks_per_seq: int, block_size: int,
                 pad_block: int, pad_slot: int, device: torch.device,
                 keep: Callable[[], Any] = lambda: None, restore: Callable[[Any], None] = lambda state: None,
                 capture: bool = True) -> None:
        self.forward, self.keep, self.restore = forward, keep, restore
        # capture=False runs the same padded, fixed-shape forward eagerly (any device): the CPU
        # tests prove its semantics in float64 against the plain path.
        self.capture = capture
        self.buckets = capture_buckets(max_num_seqs)
        self.max_width, self.block_size = max_width, block_size
        self.pad_block, self.pad_slot = pad_block, pad_slot
        n, w, m = max_num_seqs, max_width, blocks_per_seq
        # One int64 buffer holds every input, so a step is one host-to-device copy: per token
        # the input id and KV slot, per row the context length, state slot (the pad slot on
        # padded rows), row slot (-1 on padded rows), real token count, the row of the previous
        # step whose sampled token is its input (fed steps) and block table.
        self._spans = {"ids": n * w, "slots": n * w, "seq_lens": n, "state_slots": n, "row_slots": n,
                       "num_tokens": n, "fed_rows": n, "tables": n * m}
        size = sum(self._spans.values())
        self._hosts = [torch.zeros(size, dtype=torch.int64, pin_memory=device.type == "cuda") for _ in range(2)]
        # The same memory: numpy writes scalars without a torch op each.
        self._host_nps = [host.numpy() for host in self._hosts]
        self._current = 0  # the host buffer the step being loaded writes
        self._device = torch.zeros(size, dtype=torch.int64, device=device)
        self._offsets, start = {}, 0
        for name, span in self._spans.items():
            self._offsets[name] = start
            start += span
        self.blocks_per_seq = m
        self._num_tokens32 = torch.zeros(n, dtype=torch.int32, device=device)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = None
        self._rows, self._width = 0, 1
        # Per host buffer, the table each row holds there.
        self._tables_in: list[list[tuple[int, ...] | None]] = [[None] * n for _ in self._hosts]
        for _ in self._hosts:
            self._fill_pads(0, n, w)
            self._current ^= 1
        self._device.copy_(self._host)

    @property
    def _host(self) -> torch.Tensor:
        return self._hosts[self._current]

    def _view(self, name: str, length: int) -> torch.Tensor:
        start = self._offsets[name]
        return self._device[start : start + length]

    def _host_view(self, name: str):  # noqa: ANN202 - a numpy view
        start = self._offsets[name]
        return self._host_nps[self._current][start : start + self._spans[name]]

    @property
    def state_slots(self) -> torch.Tensor:
        return self._view("state_slots", self._spans["state_slots"])

    @property
    def num_tokens(self) -> torch.Tensor:
        """(max_num_seqs,) int32 real tokens of each row of the loaded step."""
        return self._num_tokens32

    def bucket(self, num_rows: int) -> int | None:
        """The smallest bucket that holds num_rows rows (None: too many)."""
        return next((b for b in self.buckets if b >= num_rows), None)

    def width(self, plan: StepPlan) -> int | None:
        """The row width of a decode-only step that fits a bucket (1, or max_width when a row
        verifies drafts); None when the step must run eagerly."""
        if not plan.seqs or self.bucket(len(plan.seqs)) is None or not all(s.is_decode for s in plan.seqs):
            return None
        return self.max_width if any(s.num_drafts for s in plan.seqs) else 1

    def _fill_pads(self, start: int, bucket: int, width: int) -> None:
        """Rows from `start` to `bucket` read and write only the pad block and the pad slot."""
        ids, slots = self._host_view("ids"), self._host_view("slots")
        ids[start * width : bucket * width] = 0
        slots[start * width : bucket * width] = self.pad_block * self.block_size
        self._host_view("seq_lens")[start:bucket] = width
        self._host_view("state_slots")[start:bucket] = self.pad_slot
        self._host_view("row_slots")[start:bucket] = -1
        self._host_view("num_tokens")[start:bucket] = width
        m = self.blocks_per_seq
        self._host_view("tables")[start * m : bucket * m] = self.pad_block
        loaded = self._tables_in[self._current]
        for i in range(start, bucket):  # those rows' tables are rewritten when a request takes them
            loaded[i] = None

    def _context(self, bucket: int, width: int) -> StepContext:
        m = self.blocks_per_seq
        seq_lens = self._view("seq_lens", bucket)
        return StepContext(
            positions=seq_lens.repeat_interleave(width) - width,  # Nemotron-H attention has no positions
            slot_mapping=self._view("slots", bucket * width),
            query_start_loc=torch.arange(0, (bucket + 1) * width, width, device=seq_lens.device),
            seq_lens=seq_lens, block_tables=self._view("tables", bucket * m).view(bucket, m),
            state_slots=self._view("state_slots", bucket), num_decodes=bucket, query_lens=(width,) * bucket,
            state_slot_list=(self.pad_slot,) * bucket, uniform_decode=width,
            decode_num_tokens=self._num_tokens32[:bucket], row_slots=self._view("row_slots", bucket),
        )

    def load(self, plan: StepPlan, width: int, fed: torch.Tensor | None = None) -> int:
        """Writes the plan's rows (each padded to `width` tokens, the rows to their bucket) into
        the device buffers with one non-blocking copy; returns the bucket. fed: the previous
        step's sampled tokens (R,) int64 on the device, when the plan has `fed_rows`: row i's
        input id is fed[fed_rows[i]], gathered on the device.

        The two pinned buffers take turns: the one written here was last copied two steps ago,
        and the host has since waited for the later of those steps' sampled tokens."""
        rows = len(plan.seqs)
        bucket = self.bucket(rows)
        assert bucket is not None
        assert (fed is None) == (not plan.fed_rows), "a plan with fed rows needs the previous step's tokens"
        assert fed is None or width == 1, "only plain decode rows are fed"
        self._current ^= 1
        bs, m, pad = self.block_size, self.blocks_per_seq, self.pad_block
        ids, slots = self._host_view("ids"), self._host_view("slots")
        seq_lens, state_slots, counts = (self._host_view(k) for k in ("seq_lens", "state_slots", "num_tokens"))
        seqs = plan.seqs
        if width == 1:  # plain decode, the common step: whole columns at once
            starts = [s.start_pos for s in seqs]
            ids[:rows] = [s.token_ids[0] for s in seqs]
            slots[:rows] = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, starts, strict=True)]
            seq_lens[:rows] = starts
            seq_lens[:rows] += 1
            counts[:rows] = 1
        else:
            for i, seq in enumerate(seqs):
                n, start, table = len(seq.token_ids), seq.start_pos, seq.block_table
                base = i * width
                ids[base : base + n] = seq.token_ids
                ids[base + n : base + width] = seq.token_ids[-1]
                slots[base : base + n] = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
                slots[base + n : base + width] = pad * bs  # padded tokens' KV goes to the pad block
                seq_lens[i], counts[i] = start + width, n
        state_slots[:rows] = [s.state_slot for s in seqs]
        self._host_view("row_slots")[:rows] = state_slots[:rows]
        if plan.fed_rows:
            self._host_view("fed_rows")[:rows] = plan.fed_rows
        # A row's table changes only when it gains a block (or the row holds another request):
        # rows whose table is the one this buffer last held are left as they are.
        tables = self._host_view("tables").reshape(-1, m)
        loaded = self._tables_in[self._current]
        for i, seq in enumerate(seqs):
            table = seq.block_table  # the cache manager's tuple: the same object until the table grows
            if loaded[i] is not table and loaded[i] != table:
                tables[i, : len(table)] = table
                tables[i, len(table) :] = pad
                loaded[i] = table
        self._fill_pads(rows, bucket, width)
        self._rows, self._width = rows, width
        self._copy(bucket, width)
        if fed is not None:  # after the copy, which wrote placeholders there
            self._view("ids", rows).copy_(fed.index_select(0, self._view("fed_rows", rows)))
        return bucket

    def _copy(self, bucket: int, width: int) -> None:
        # The spans lie in order with the tables last: one copy up to the bucket's last table row.
        end = self._offsets["tables"] + bucket * self.blocks_per_seq
        self._device[:end].copy_(self._host[:end], non_blocking=True)
        self._num_tokens32[:bucket].copy_(self._view("num_tokens", bucket))

    @property
    def shapes(self) -> tuple[tuple[int, int], ...]:
        """Every (bucket, width) a step can take: each bucket at width 1, and at 1 + k with speculation."""
        widths = (1,) if self.max_width == 1 else (1, self.max_width)
        return tuple((bucket, width) for width in widths for bucket in self.buckets)

    def prepare_all(self) -> tuple[tuple[int, int], ...]:
        """Captures the graph of every shape not yet captured (with `capture=False`, runs each
        shape's forward once on pad rows, which compiles its kernels); returns the shapes. The step
        loaded last keeps its buffers. Startup warm-up (`engine/warmup.py`)."""
        for bucket, width in self.shapes:
            if not self.capture:
                self._run_on_pads(bucket, width)
            elif (bucket, width) not in self._graphs:
                self._capture(bucket, width)
        return self.shapes

    def run(self, bucket: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Replays the graph of (bucket, width), capturing it first if needed; hidden
        (bucket * width, D) and logits (bucket * width, V), valid until the next replay."""
        if not self.capture:
            return self.forward(self._view("ids", bucket * width), self._context(bucket, width))
        graph = self._graphs.get((bucket, width))
        if graph is None:
            graph = self._capture(bucket, width)
        graph.graph.replay()
        self.restore(graph.state)
        return graph.hidden, graph.logits

    def _run_on_pads(self, bucket: int, width: int, stream: torch.cuda.Stream | None = None) -> None:
        """The forward of (bucket, width) on pad rows only, the loaded step's buffers kept. A decode
        step is not idempotent (it advances states and writes KV), so only rows that read and write
        the pad block and pad slot may run outside a real step."""
        if self._device.is_cuda:
            # The host buffer is rewritten below while its copy to the device may still be queued
            # (behind a running step, with async scheduling): let it land first.
            torch.cuda.current_stream().synchronize()
        saved_device, saved_host = self._device.clone(), self._host.clone()
        saved_counts = self._num_tokens32.clone()
        self._fill_pads(0, bucket, width)
        self._copy(bucket, width)
        ids, ctx = self._view("ids", bucket * width), self._context(bucket, width)
        if stream is None:
            self.forward(ids, ctx)
        else:
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.forward(ids, ctx)
            torch.cuda.current_stream().wait_stream(stream)
        self._device.copy_(saved_device)
        self._host.copy_(saved_host)
        self._num_tokens32.copy_(saved_counts)

    def _capture(self, bucket: int, width: int) -> _Graph:
        # Triton kernels compile on their first call, which a capture cannot hold, so the forward
        # runs once before it, on pad rows and a side stream; capturing itself executes nothing.
        self._run_on_pads(bucket, width, torch.cuda.Stream())
        ctx = self._context(bucket, width)
        ids = self._view("ids", bucket * width)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, logits = self.forward(ids, ctx)
        self._pool = graph.pool()
        logger.debug("captured the decode graph of batch size %d, width %d", bucket, width)
        self._graphs[(bucket, width)] = _Graph(graph, hidden, logits, self.keep(), ctx)
        return self._graphs[(bucket, width)]
