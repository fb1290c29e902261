"""The ReplaySSM Gated DeltaNet backend: a checkpoint plus rings of recent (k, delta, g); the state
is written on a flush (docs/replayssm.md, section Gated DeltaNet).

Prefill (shared with the baseline, `gated_delta_backend`) writes canonical state into the
checkpoint and leaves the slot's cursors at zero, since a prefilling slot is always fresh.

Cursors, their moves (Mamba2's ops) and publishing are `ReplayCursors`'; a rejected draft is
rolled back by the commit's cursor move alone. Decode and verify are one ``replay_gdn_step`` each:
no host sync and fixed shapes, so both run inside CUDA graphs, padded rows on the pad slot.
"""

from __future__ import annotations

import torch

from replayserve.config import check_replay_window
from replayserve.ops.conv1d import causal_conv1d_update, causal_conv1d_verify
from replayserve.ops.copy_rows import copy_rows
from replayserve.ops.replay_gdn import replay_gdn_materialize, replay_gdn_step
from replayserve.ssm.gated_delta_backend import GatedDeltaBackend
from replayserve.ssm.layout import GatedDeltaLayout
from replayserve.ssm.replay_cursors import ReplayCursors


class GatedDeltaReplayBackend(ReplayCursors, GatedDeltaBackend):
    def __init__(self, layout: GatedDeltaLayout, device: torch.device) -> None:
        check_replay_window(layout.window, layout.tokens_per_step)  # EngineConfig's check, for hand-made layouts
        super().__init__(layout, device)
        self.k_ring = self._pool(layout.k_ring_shape, layout.act_dtype)
        self.delta_ring = self._pool(layout.delta_ring_shape, layout.state_dtype)
        self.g_ring = self._pool(layout.gate_ring_shape, layout.state_dtype)
        self._init_cursors(device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_state, *self.ssm_state, *self.k_ring, *self.delta_ring, *self.g_ring,
                self.ring_start, self.history, self.is_flush]

    def _rings(self, layer: int) -> tuple[torch.Tensor, ...]:
        """One layer's pool as the ops take it: the checkpoint, then the k, delta and g rings."""
        return self.ssm_state[layer], self.k_ring[layer], self.delta_ring[layer], self.g_ring[layer]

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The checkpoint, rings and cursors move together, so any slot's state is copied whole. A
        prefix hit's source is a boundary slot, which `publish` materialized (zero cursors): the
        destination then starts with empty history, and its rings are never read before written."""
        super().copy_slots(src, dst)
        for t in (*self.k_ring, *self.delta_ring, *self.g_ring):
            copy_rows(t, src, t, dst)
        for cursor in self.cursors:
            cursor.index_copy_(0, dst, cursor.index_select(0, src))

    def publish(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                A: list[torch.Tensor]) -> None:
        """Materializes: the checkpoint folded with the first `history - lag` committed ring entries.
        A: unused (Mamba2's decay rates; GDN's decays are in the g ring)."""
        def materialize(layer: int, start: torch.Tensor, n: torch.Tensor) -> None:
            replay_gdn_materialize(*self._rings(layer), src, dst, start, n, use_qk_l2norm=True)

        self._publish_materialized(rows, src, dst, lag, materialize)

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
