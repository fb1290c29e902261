"""The ReplaySSM Gated DeltaNet backend: a checkpoint plus rings of recent (k, v, g, beta); the state
is written on a flush (docs/replayssm.md, section Gated DeltaNet).

Prefill (shared with the baseline, `gated_delta_backend`) writes canonical state into the
checkpoint and leaves the slot's cursors at zero, since a prefilling slot is always fresh.

Cursors (`ring_start`, `history`, `is_flush`) belong to a slot and are shared by every GDN layer,
moved by Mamba2's ops: `begin_step` sets the flush flags before the forward (``replay_prepare``),
`end_step` commits once after sampling (``replay_commit``); a rejected draft is rolled back by the
commit's cursor move alone. Decode and verify are one ``replay_gdn_step`` each: no host sync and
fixed shapes, so both run inside CUDA graphs, padded rows on the pad slot.
"""

from __future__ import annotations

import torch

from replayserve.config import check_replay_window
from replayserve.ops.conv1d import causal_conv1d_update, causal_conv1d_verify
from replayserve.ops.copy_rows import copy_rows
from replayserve.ops.replay_gdn import replay_gdn_materialize, replay_gdn_step
from replayserve.ops.replay_ssm import replay_commit, replay_prepare
from replayserve.ssm.gated_delta_backend import GatedDeltaBackend
from replayserve.ssm.layout import GatedDeltaLayout
from replayserve.ssm.slot_state import conv_state_after


class GatedDeltaReplayBackend(GatedDeltaBackend):
    def __init__(self, layout: GatedDeltaLayout, device: torch.device) -> None:
        check_replay_window(layout.window, layout.tokens_per_step)  # EngineConfig's check, for hand-made layouts
        super().__init__(layout, device)
        self.k_ring = self._pool(layout.k_ring_shape, layout.act_dtype)
        self.v_ring = self._pool(layout.v_ring_shape, layout.act_dtype)
        self.g_ring = self._pool(layout.gate_ring_shape, layout.state_dtype)
        self.beta_ring = self._pool(layout.gate_ring_shape, layout.state_dtype)
        self.ring_start = torch.zeros(layout.cursor_shape, dtype=torch.int32, device=device)
        self.history = torch.zeros(layout.cursor_shape, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(layout.cursor_shape, dtype=torch.bool, device=device)
        # A decode step's token counts (all 1), sliced per step: no fill kernel in every layer.
        self._ones = torch.ones(layout.cursor_shape, dtype=torch.int32, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_state, *self.ssm_state, *self.k_ring, *self.v_ring, *self.g_ring, *self.beta_ring,
                self.ring_start, self.history, self.is_flush]

    def _rings(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer's pool as the ops take it: the checkpoint, then the k, v, g and beta rings."""
        return self.ssm_state[layer], self.k_ring[layer], self.v_ring[layer], self.g_ring[layer], self.beta_ring[layer]

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The checkpoint, rings and cursors move together, so any slot's state is copied whole. A
        prefix hit's source is a boundary slot, which `publish` materialized (zero cursors): the
        destination then starts with empty history, and its rings are never read before written."""
        super().copy_slots(src, dst)
        for t in (*self.k_ring, *self.v_ring, *self.g_ring, *self.beta_ring):
            copy_rows(t, src, t, dst)
        for cursor in (self.ring_start, self.history, self.is_flush):
            cursor.index_copy_(0, dst, cursor.index_select(0, src))

    def publish(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                A: list[torch.Tensor]) -> None:
        """Materializes: the checkpoint folded with the first `history - lag` committed ring entries
        (on the device, no sync); boundary slots are never live, so their cursors stay zero. A: unused
        (Mamba2's decay rates; GDN's decays are in the g ring)."""
        if src.numel() == 0:
            return
        start = self.ring_start.index_select(0, src)
        n = self.history.index_select(0, src) - lag
        j = self._accepted[rows] - lag if self._windows else None  # this step's tokens up to the boundary
        for layer in range(self.layout.num_layers):
            replay_gdn_materialize(*self._rings(layer), src, dst, start, n, use_qk_l2norm=True)
            if j is not None:  # the conv state is the last K - 1 inputs before the boundary
                self.conv_state[layer][dst] = conv_state_after(self._windows[layer][rows], j,
                                                               self.layout.conv_kernel - 1)
            else:
                self.conv_state[layer][dst] = self.conv_state[layer][src]

    def begin_step(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        super().begin_step(slots, num_tokens)
        fresh = torch.zeros_like(slots, dtype=torch.bool)  # fresh slots were reset at admission
        replay_prepare(self.ring_start, self.history, self.is_flush, slots, num_tokens, fresh, self.layout.window,
                       pad_slot=self._pad_slot)

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)
        replay_commit(self.ring_start, self.history, self.is_flush, slots, num_accepted, self.layout.ring_len,
                      pad_slot=self._pad_slot)

    def _step(self, layer: int, slots: torch.Tensor, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              num_tokens: torch.Tensor) -> torch.Tensor:
        """n tokens per row from checkpoint + ring: mixed (B, T, conv_dim) post-conv, g and beta (B, T, Hv)."""
        q, k, v = self.layout.split_qkv(mixed)
        return replay_gdn_step(*self._rings(layer), self.ring_start, self.history, self.is_flush, slots, num_tokens,
                               q, k, v, g, beta, use_qk_l2norm=True, pad_slot=self._pad_slot)

    def decode(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               conv_weight: torch.Tensor) -> torch.Tensor:
        mixed = causal_conv1d_update(qkv, self.conv_state[layer], conv_weight, None, slots)
        return self._step(layer, slots, mixed[:, None], g[:, None], beta[:, None], self._ones[: slots.shape[0]])[:, 0]

    def verify(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               num_tokens: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Tokens past a row's num_tokens are ignored; its rejected ones stay past `history` in the ring."""
        mixed, self._windows[layer] = causal_conv1d_verify(qkv, self.conv_state[layer], conv_weight, None, slots)
        return self._step(layer, slots, mixed, g, beta, num_tokens)
