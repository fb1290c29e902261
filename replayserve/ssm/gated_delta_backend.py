"""The seam between a Gated DeltaNet mixer and the state it reads and writes, and the prefill both
GDN backends share.

The mixer calls `prefill_batch` (the step's packed prefill segments, each with its boundary
captures), `decode` (one token per row) and `verify` (up to T tokens per row from the live state,
committing nothing: `end_step` keeps each row's accepted prefix). The slot-level methods the runner,
the CUDA-graph path and prefix caching call are `SlotStateBackend`'s.

Inputs are the conv's inputs `qkv` (q, k and v concatenated, pre-conv, pre-L2-norm) with the
log-space decay `g` and the write strength `beta` already computed by the mixer; outputs are the
rule's `o` per value head, before the gated norm.

Prefill leaves canonical state in the slot: the baseline continues from it, and ReplaySSM takes it
as the checkpoint with empty history (a prefilling slot is fresh, or a prefix hit's copy, whose
cursors `copy_slots` zeroed), so both backends share it.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence

import torch

from replayserve.ops.conv1d import causal_conv1d_varlen
from replayserve.ops.gated_delta import chunk_gated_delta
from replayserve.ssm.layout import GatedDeltaLayout
from replayserve.ssm.params import Segment
from replayserve.ssm.slot_state import SlotStateBackend


class GatedDeltaBackend(SlotStateBackend):
    """Owns the conv and recurrent state of every GDN layer, indexed by state slot."""

    layout: GatedDeltaLayout

    def __init__(self, layout: GatedDeltaLayout, device: torch.device) -> None:
        self.layout, self.device = layout, device
        # The fixed-shape decode path pads with the pad slot (the last, which no pool hands out).
        self._pad_slot = layout.num_slots - 1
        self.conv_state = self._pool(layout.conv_state_shape, layout.act_dtype)
        self.ssm_state = self._pool(layout.ssm_state_shape, layout.state_dtype)
        self._init_step_state()
        self._prefill_metas: dict[tuple, dict[str, torch.Tensor | None]] = {}

    def _pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
        """One zeroed tensor per layer: padded and never-used slots must hold finite values."""
        return [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self.layout.num_layers)]

    def prefill_batch(self, layer: int, segments: Sequence[Segment], qkv: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Every prefill sequence of a step in one pass per op (the varlen conv and the chunked rule).

        segments: ``StepContext.prefill_segments()``, contiguous, each with at least one token; qkv
        (T, conv_dim), g and beta (T, Hv) the whole step's tokens; conv_weight (conv_dim, K_conv).
        Returns o (hi - lo, Hv, V) for the segments' tokens lo = segments[0][0] to hi = segments[-1][1].
        Each sequence continues from and ends in its slot; a capture (offset, boundary slot) writes
        the state after the sequence's first `offset` tokens (0 < offset <= its length) into that slot.
        """
        lo, hi = segments[0][0], segments[-1][1]
        conv_state, ssm_state = self.conv_state[layer], self.ssm_state[layer]
        meta = self._prefill_meta(segments)
        mixed = causal_conv1d_varlen(qkv[lo:hi], conv_weight, None, conv_state, meta["slots"], meta["cu_seqlens"],
                                     captures=meta["conv_captures"], end_slots=meta["end_slots"])
        q, k, v = self.layout.split_qkv(mixed)
        o, finals, captured = chunk_gated_delta(q, k, v, g[lo:hi], beta[lo:hi], meta["cu_seqlens"],
                                                initial_state=ssm_state, state_indices=meta["slots"],
                                                use_qk_l2norm=True, capture_seqs=meta["capture_seqs"],
                                                capture_lens=meta["capture_lens"])
        ssm_state.index_copy_(0, meta["slots"], finals.to(ssm_state.dtype))
        if meta["capture_dst"] is not None:
            ssm_state.index_copy_(0, meta["capture_dst"], captured.to(ssm_state.dtype))
        return o

    def prefill(self, layer: int, slot: int, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_weight: torch.Tensor, captures: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """One sequence's prefill chunk from the state in `slot`, which then holds the state after it:
        `prefill_batch` of one segment. qkv (L, conv_dim); g, beta (L, Hv). Returns o (L, Hv, V)."""
        return self.prefill_batch(layer, [(0, qkv.shape[0], slot, captures, 0)], qkv, g, beta, conv_weight)

    def _prefill_meta(self, segments: Sequence[Segment]) -> dict[str, torch.Tensor | None]:
        """The segments' varlen metadata, int64 on the device: cu_seqlens (N+1,), slots (N,); the
        conv's inner captures (sequence, packed token, slot) and end slots (N,) (-1: none); the
        rule's captures as sequence, tokens and boundary slot, (C,) each. Every GDN layer of a step
        asks for the same: one host-to-device copy serves them all (keyed by content, so an entry
        never goes stale)."""
        key = tuple((end - start, slot, captures) for start, end, slot, captures, _ in segments)
        meta = self._prefill_metas.get(key)
        if meta is not None:
            return meta
        if len(self._prefill_metas) >= 1024:
            self._prefill_metas.clear()
        lens = [n for n, _, _ in key]
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        every = [(s, o, dst) for s, (_, _, caps) in enumerate(key) for o, dst in caps]
        inner = [(s, cu[s] + o, dst) for s, o, dst in every if o < lens[s]]
        ends = [next((dst for o, dst in caps if o == n), -1) for n, _, caps in key]
        fields = {"cu_seqlens": cu, "slots": [slot for _, slot, _ in key],
                  "capture_seqs": [s for s, _, _ in every], "capture_lens": [o for _, o, _ in every],
                  "capture_dst": [d for _, _, d in every], "conv_seq": [s for s, _, _ in inner],
                  "conv_token": [t for _, t, _ in inner], "conv_dst": [d for _, _, d in inner], "end_slots": ends}
        # Each view starts on a 16-byte boundary: Triton compiles a variant per pointer alignment.
        padded = [values + [0] * (len(values) % 2) for values in fields.values()]
        flat = torch.tensor([v for values in padded for v in values], dtype=torch.int64).to(self.device)
        views: dict[str, torch.Tensor | None] = {}
        at = 0
        for (name, values), stored in zip(fields.items(), padded, strict=True):
            views[name] = flat[at : at + len(values)] if values else None
            at += len(stored)
        conv_captures = (views.pop("conv_seq"), views.pop("conv_token"), views.pop("conv_dst"))
        views["conv_captures"] = conv_captures if inner else None  # type: ignore[assignment]
        if not every:  # with any capture, end slots go too (all -1 if none): one conv kernel variant less
            views["end_slots"] = None
        self._prefill_metas[key] = views
        return views

    @abstractmethod
    def decode(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               conv_weight: torch.Tensor) -> torch.Tensor:
        """Advances each row's slot by one token: slots (B,) int64, qkv (B, conv_dim) pre-conv,
        g and beta (B, Hv). Returns o (B, Hv, V)."""

    @abstractmethod
    def verify(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               num_tokens: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Rows of up to T tokens from their live state (a speculative verify), committing
        nothing: `end_step` keeps each row's accepted prefix. qkv (B, T, conv_dim), g and beta
        (B, T, Hv) padded; num_tokens (B,) int32. Returns o (B, T, Hv, V)."""
