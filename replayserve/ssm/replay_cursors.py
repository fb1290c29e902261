"""What every ReplaySSM backend (Mamba2's and Gated DeltaNet's) shares: a slot's cursors and
their moves, and the publishing of a canonical state into a boundary slot.

Cursors (`ring_start`, `history`, `is_flush`) belong to a slot and are shared by every layer:
`begin_step` sets the flush flags before the forward (``replay_prepare``), `end_step` commits once
after sampling (``replay_commit``); a rejected draft is rolled back by the commit's cursor move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from replayserve.ops.replay_ssm import replay_commit, replay_prepare
from replayserve.ssm.slot_state import conv_state_after


class ReplayCursors:
    """Mixed in before the backend's slot-state base class, which provides `layout`, `conv_state`,
    `_windows`, `_accepted`, `begin_step` and `end_step`."""

    def _init_cursors(self, device: torch.device) -> None:
        shape = self.layout.cursor_shape
        # The fixed-shape decode path pads with the pad slot (the last, which no pool hands out).
        self._pad_slot = self.layout.num_slots - 1
        self.ring_start = torch.zeros(shape, dtype=torch.int32, device=device)
        self.history = torch.zeros(shape, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(shape, dtype=torch.bool, device=device)
        # A decode step's token counts (all 1), sliced per step: no fill kernel in every layer.
        self._ones = torch.ones(shape, dtype=torch.int32, device=device)

    @property
    def cursors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ring_start, self.history, self.is_flush

    def _publish_materialized(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                              materialize: Callable[[int, torch.Tensor, torch.Tensor], None]) -> None:
        """Writes into boundary slots `dst` the canonical state of live slots `src` `lag` tokens
        before their ends: `materialize(layer, ring_start, n)` folds the checkpoint with the first
        n = history - lag committed ring entries (on the device, no sync); the conv state is the
        last K - 1 inputs before the boundary. Boundary slots are never live: their cursors stay 0."""
        if src.numel() == 0:
            return
        start = self.ring_start.index_select(0, src)
        n = self.history.index_select(0, src) - lag
        j = self._accepted[rows] - lag if self._windows else None  # this step's tokens up to the boundary
        for layer in range(self.layout.num_layers):
            materialize(layer, start, n)
            if j is not None:
                self.conv_state[layer][dst] = conv_state_after(self._windows[layer][rows], j,
                                                               self.layout.conv_kernel - 1)
            else:
                self.conv_state[layer][dst] = self.conv_state[layer][src]

    def begin_step(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        super().begin_step(slots, num_tokens)  # type: ignore[misc]
        fresh = torch.zeros_like(slots, dtype=torch.bool)  # fresh slots were reset at admission
        replay_prepare(*self.cursors, slots, num_tokens, fresh, self.layout.window, pad_slot=self._pad_slot)

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)  # type: ignore[misc]
        replay_commit(*self.cursors, slots, num_accepted, self.layout.ring_len, pad_slot=self._pad_slot)
