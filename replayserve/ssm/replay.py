"""The ReplaySSM backend: a checkpoint plus rings of recent (x, dt, B); the state is written on flush.

Prefill (shared with the baseline) writes canonical state into the checkpoint and leaves the
slot's cursors at zero, since a prefilling slot is always fresh.

Cursors, their moves and publishing are `ReplayCursors`' (shared with the Gated DeltaNet backend).
"""

from __future__ import annotations

import torch

from replayserve.config import check_replay_window
from replayserve.ops.conv1d import causal_conv1d_update
from replayserve.ops.replay_ssm import replay_materialize, replay_step
from replayserve.ssm.backend import SSMBackend
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.params import MambaParams
from replayserve.ssm.replay_cursors import ReplayCursors


class ReplayBackend(ReplayCursors, SSMBackend):
    def __init__(self, layout: MambaLayout, device: torch.device) -> None:
        check_replay_window(layout.window, layout.tokens_per_step)  # EngineConfig's check, for hand-made layouts
        self.layout = layout

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            # Zero-initialised: padded and never-used slots must hold finite values.
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]

        self.conv_state = zeros(layout.conv_state_shape, layout.act_dtype)
        self.ssm_state = zeros(layout.ssm_state_shape, layout.state_dtype)
        self.x_ring = zeros(layout.x_ring_shape, layout.act_dtype)
        self.dt_ring = zeros(layout.dt_ring_shape, layout.state_dtype)
        self.b_ring = zeros(layout.b_ring_shape, layout.act_dtype)
        self._init_step_state()
        self._init_cursors(device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_state, *self.ssm_state, *self.x_ring, *self.dt_ring, *self.b_ring,
                self.ring_start, self.history, self.is_flush]

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        super().copy_slots(src, dst)
        for cursor in self.cursors:  # the copy starts with empty history
            cursor.index_fill_(0, dst, 0)

    def publish(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                A: list[torch.Tensor]) -> None:
        """Materializes: the checkpoint plus the first `history - lag` committed ring entries."""
        def materialize(layer: int, start: torch.Tensor, n: torch.Tensor) -> None:
            replay_materialize(self.ssm_state[layer], self.x_ring[layer], self.dt_ring[layer], self.b_ring[layer],
                               A[layer], src, dst, start, n)

        self._publish_materialized(rows, src, dst, lag, materialize)

    def decode(
        self, layer: int, slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
        conv_done: bool = False,
    ) -> torch.Tensor:
        if not conv_done:
            xbc = causal_conv1d_update(xbc, self.conv_state[layer], params.conv_weight, params.conv_bias, slots)
        x, b, c = self.layout.split_xbc(xbc)
        ones = self._ones[: slots.shape[0]]
        y = replay_step(
            self.ssm_state[layer], self.x_ring[layer], self.dt_ring[layer], self.b_ring[layer],
            self.ring_start, self.history, self.is_flush, slots, ones,
            x[:, None], dt[:, None], params.A, b[:, None], c[:, None], params.D, params.dt_bias, params.dt_limit,
            pad_slot=self._pad_slot,
        )
        return y[:, 0]

    def _verify_ssm(self, layer: int, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor,
                    c: torch.Tensor, num_tokens: torch.Tensor, params: MambaParams) -> torch.Tensor:
        """T tokens from checkpoint + ring; rollback of rejected ones is the commit's cursor move."""
        return replay_step(
            self.ssm_state[layer], self.x_ring[layer], self.dt_ring[layer], self.b_ring[layer],
            self.ring_start, self.history, self.is_flush, slots, num_tokens,
            x, dt, params.A, b, c, params.D, params.dt_bias, params.dt_limit, pad_slot=self._pad_slot,
        )
