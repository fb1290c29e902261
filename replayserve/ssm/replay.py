"""The ReplaySSM backend: a checkpoint plus rings of recent (x, dt, B); the state is written on flush.

Prefill (shared with the baseline) writes canonical state into the checkpoint and leaves the
slot's cursors at zero, since a prefilling slot is always fresh.

Cursors (`ring_start`, `history`, `is_flush`) belong to a slot and are shared by every Mamba layer:
`begin_step` sets the flush flags before the forward, `end_step` commits once after sampling.
"""

from __future__ import annotations

import torch

from replayserve.config import check_replay_window
from replayserve.ops.conv1d import causal_conv1d_update
from replayserve.ops.replay_ssm import replay_commit, replay_materialize, replay_prepare, replay_step
from replayserve.ssm.backend import SSMBackend
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.params import MambaParams
from replayserve.ssm.slot_state import conv_state_after


class ReplayBackend(SSMBackend):
    def __init__(self, layout: MambaLayout, device: torch.device) -> None:
        check_replay_window(layout.window, layout.tokens_per_step)  # EngineConfig's check, for hand-made layouts
        self.layout = layout
        # The fixed-shape decode path pads with the pad slot (the last, which no pool hands out).
        self._pad_slot = layout.num_slots - 1

        def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
            # Zero-initialised: padded and never-used slots must hold finite values.
            return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layout.num_layers)]

        self.conv_state = zeros(layout.conv_state_shape, layout.act_dtype)
        self.ssm_state = zeros(layout.ssm_state_shape, layout.state_dtype)
        self.x_ring = zeros(layout.x_ring_shape, layout.act_dtype)
        self.dt_ring = zeros(layout.dt_ring_shape, layout.state_dtype)
        self.b_ring = zeros(layout.b_ring_shape, layout.act_dtype)
        self._init_step_state()
        self.ring_start = torch.zeros(layout.cursor_shape, dtype=torch.int32, device=device)
        self.history = torch.zeros(layout.cursor_shape, dtype=torch.int32, device=device)
        self.is_flush = torch.zeros(layout.cursor_shape, dtype=torch.bool, device=device)
        # A decode step's token counts (all 1), sliced per step: no fill kernel in every layer.
        self._ones = torch.ones(layout.cursor_shape, dtype=torch.int32, device=device)

    def state_tensors(self) -> list[torch.Tensor]:
        return [*self.conv_state, *self.ssm_state, *self.x_ring, *self.dt_ring, *self.b_ring,
                self.ring_start, self.history, self.is_flush]

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        super().copy_slots(src, dst)
        for cursor in (self.ring_start, self.history, self.is_flush):  # the copy starts with empty history
            cursor.index_fill_(0, dst, 0)

    def publish(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                A: list[torch.Tensor]) -> None:
        """Materializes: the checkpoint plus the first `history - lag` committed ring entries
        (on the device, no sync); boundary slots are never live, so their cursors stay zero."""
        if src.numel() == 0:
            return
        start = self.ring_start.index_select(0, src)
        n = self.history.index_select(0, src) - lag
        j = self._accepted[rows] - lag if self._windows else None  # this step's tokens up to the boundary
        for layer in range(self.layout.num_layers):
            replay_materialize(self.ssm_state[layer], self.x_ring[layer], self.dt_ring[layer], self.b_ring[layer],
                               A[layer], src, dst, start, n)
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

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)
        replay_commit(self.ring_start, self.history, self.is_flush, slots, num_accepted, self.layout.ring_len,
                      pad_slot=self._pad_slot)
