"""The seam between a Mamba2 mixer and the state it reads and writes."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from replayserve.ops.conv1d import causal_conv1d_ref, causal_conv1d_verify
from replayserve.ops.dispatch import use_triton
from replayserve.ops.ssd import ssd_chunk_scan_ref
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.params import MambaParams, Segment
from replayserve.ssm.slot_state import SlotStateBackend

if TYPE_CHECKING:
    from replayserve.ssm.packed_prefill import PrefillPlan


class SSMBackend(SlotStateBackend):
    """Owns the conv and SSM state of every Mamba layer, indexed by state slot; the Mamba2 mixer's
    prefill, decode and verify run here (the slot-level methods are `SlotStateBackend`'s)."""

    layout: MambaLayout

    def prefill_batch(self, layer: int, segments: Sequence[Segment], xbc: torch.Tensor, dt: torch.Tensor,
                      params: MambaParams, plan: PrefillPlan | None = None, packed: bool | None = None) -> torch.Tensor:
        """Every prefill sequence of a step, each as `prefill` would run it.

        segments: ``StepContext.prefill_segments()``, contiguous, each with at least one token;
        xbc: (T, conv_dim) and dt: (T, H) the whole step's tokens. Returns y (hi - lo, H, P) for
        the segments' tokens lo = segments[0][0] to hi = segments[-1][1].
        plan: the step's packed prefill metadata (``StepContext.prefill_plan``, built once by the
        runner for every layer): all sequences run in one pass per op (the packed varlen conv1d
        and SSD scan kernels). Without it, `packed` says whether to build one for this call and run
        packed, or to run one `prefill` call per sequence; None: packed where the kernels serve
        the activations (CUDA).
        """
        lo, hi = segments[0][0], segments[-1][1]
        if plan is None and not (use_triton(xbc) if packed is None else packed):
            ys = [self.prefill(layer, slot, xbc[start:end], dt[start:end], params, captures, first % params.chunk_size)
                  for start, end, slot, captures, first in segments]
            return ys[0] if len(ys) == 1 else torch.cat(ys)
        from replayserve.ssm.packed_prefill import build_prefill_plan, packed_prefill  # imports Triton: lazily

        if plan is None:
            plan = build_prefill_plan(segments, params.chunk_size, xbc.device)
        return packed_prefill(plan, self.conv_state[layer], self.ssm_state[layer], xbc[lo:hi], dt[lo:hi], params,
                              self.layout.split_xbc)

    def prefill(
        self, layer: int, slot: int, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
        captures: tuple[tuple[int, int], ...] = (), phase: int = 0,
    ) -> torch.Tensor:
        """Runs one sequence's prefill chunk from the state in `slot` and stores the state after it.

        xbc: (L, conv_dim) pre-conv inputs; dt: (L, H) raw time steps. Returns y (L, H, P). The
        stored state is canonical: both backends continue decode from it with empty history.
        captures: (offset, boundary slot) pairs, ascending: the state after the chunk's first
        `offset` tokens (0 < offset <= L) is also written into that slot (prefix caching).
        phase: the chunk's first position modulo the SSD chunk size. Captures on the sequence's
        chunk grid come out of one scan; one off the grid splits the chunk there.
        """
        q, length = params.chunk_size, xbc.shape[0]
        pieces, begin, held = [], 0, []
        for offset, dst in captures:
            held.append((offset, dst))
            if (phase + offset) % q and offset < length:
                pieces.append((begin, offset, held))
                begin, held = offset, []
        pieces.append((begin, length, held))
        ys = [self._scan(layer, slot, xbc[lo:hi], dt[lo:hi], params, tuple((o - lo, d) for o, d in caps),
                         (phase + lo) % q)
              for lo, hi, caps in pieces if hi > lo]
        return ys[0] if len(ys) == 1 else torch.cat(ys)

    def _scan(self, layer: int, slot: int, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
              captures: tuple[tuple[int, int], ...], phase: int) -> torch.Tensor:
        """One scan from `slot`'s state; captures on the chunk grid (`phase` as in `prefill`) or
        at the end. The grid ones are written with one gather per state tensor."""
        conv_state, ssm_state = self.conv_state[layer], self.ssm_state[layer]
        length = xbc.shape[0]
        inner = [(o, d) for o, d in captures if o < length]
        # The conv state after `o` tokens is the K - 1 inputs before position o.
        inputs = torch.cat([conv_state[slot].T, xbc]) if inner else None
        xbc, conv_state[slot] = causal_conv1d_ref(xbc, params.conv_weight, params.conv_bias, conv_state[slot])
        x, b, c = self.layout.split_xbc(xbc)
        y, ssm_state[slot], *grid = ssd_chunk_scan_ref(
            x, dt, params.A, b, c, params.chunk_size, D=params.D, dt_bias=params.dt_bias,
            dt_limit=params.dt_limit, initial_state=ssm_state[slot], return_chunk_states=bool(inner),
            chunk_phase=phase if inner else 0,
        )
        if inner:
            dst, window, entry = self._capture_index(tuple(inner), phase, params.chunk_size, ssm_state.device)
            conv_state[dst] = inputs.unfold(0, conv_state.shape[-1], 1)[window]
            ssm_state[dst] = grid[0][entry]
        if captures and captures[-1][0] == length:
            self.copy_canonical(layer, slot, captures[-1][1])
        return y

    def _capture_index(self, captures: tuple[tuple[int, int], ...], phase: int, chunk_size: int,
                       device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(boundary slots, conv window starts, chunk-grid entries) of in-scan captures, (M,) each.
        Every Mamba layer of a step asks for the same ones: one host-to-device copy serves them
        all (keyed by content, so an entry never goes stale)."""
        key = (captures, phase, chunk_size)
        index = self._capture_indices.get(key)
        if index is None:
            if len(self._capture_indices) >= 1024:
                self._capture_indices.clear()
            rows = [[d for _, d in captures], [o for o, _ in captures],
                    [(phase + o) // chunk_size for o, _ in captures]]
            index = self._capture_indices[key] = torch.tensor(rows, dtype=torch.int64, device=device)
        return index[0], index[1], index[2]

    def verify(
        self, layer: int, slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, num_tokens: torch.Tensor,
        params: MambaParams,
    ) -> torch.Tensor:
        """Rows of up to T tokens from their live state (a speculative verify), committing
        nothing: `end_step` keeps each row's accepted prefix. xbc (B, T, conv_dim) and dt (B, T, H)
        padded; num_tokens (B,) int32. Returns y (B, T, H, P)."""
        rows, tokens = xbc.shape[:2]
        xbc, self._windows[layer] = causal_conv1d_verify(
            xbc, self.conv_state[layer], params.conv_weight, params.conv_bias, slots)
        x, b, c = self.layout.split_xbc(xbc.reshape(rows * tokens, -1))
        shaped = [t.reshape(rows, tokens, *t.shape[1:]) for t in (x, b, c)]
        return self._verify_ssm(layer, slots, shaped[0], dt, shaped[1], shaped[2], num_tokens, params)

    def _verify_ssm(self, layer: int, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor,
                    c: torch.Tensor, num_tokens: torch.Tensor, params: MambaParams) -> torch.Tensor:
        """The SSM part of `verify`: x (B, T, H, P), dt (B, T, H), b and c (B, T, G, N)."""
        raise NotImplementedError(f"{type(self).__name__} does not verify multi-token rows")

    @abstractmethod
    def decode(
        self, layer: int, slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
        conv_done: bool = False,
    ) -> torch.Tensor:
        """Advances each row's slot by one token.

        slots: (B,) int64; xbc: (B, conv_dim); dt: (B, H). Returns y (B, H, P). With `conv_done`,
        xbc is already the conv's output and `conv_state[layer]` already advanced (the batch-1
        in_proj GEMV does both in its epilogue).
        """
