"""The baseline SSM backend: every decode step reads and writes the full recurrent state."""

from __future__ import annotations

import torch

from replayserve.ops.conv1d import causal_conv1d_update
from replayserve.ops.ssu import selective_state_update
from replayserve.ssm.backend import SSMBackend
from replayserve.ssm.layout import MambaLayout
from replayserve.ssm.params import MambaParams


class BaselineBackend(SSMBackend):
    def __init__(self, layout: MambaLayout, device: torch.device) -> None:
        self.layout = layout
        # Zero-initialised so padded or never-used slots hold finite values.
        self.conv_state = [
            torch.zeros(layout.conv_state_shape, dtype=layout.act_dtype, device=device)
            for _ in range(layout.num_layers)
        ]
        self.ssm_state = [
            torch.zeros(layout.ssm_state_shape, dtype=layout.state_dtype, device=device)
            for _ in range(layout.num_layers)
        ]
        self._init_step_state()
        if layout.tokens_per_step > 1:  # native speculation: one state per verified position
            shape = (layout.num_slots, layout.tokens_per_step, *layout.ssm_state_shape[1:])
            self.spec_states = [torch.zeros(shape, dtype=layout.state_dtype, device=device)
                                for _ in range(layout.num_layers)]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.conv_state + self.ssm_state + self.spec_states

    def _verify_ssm(self, layer: int, slots: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, b: torch.Tensor,
                    c: torch.Tensor, num_tokens: torch.Tensor, params: MambaParams) -> torch.Tensor:
        """Token by token from a copy of the live state, keeping the state after each token."""
        work = self.ssm_state[layer][slots].clone()
        ys = []
        for t in range(x.shape[1]):  # padded tokens run too; their states are never kept
            ys.append(selective_state_update(work, x[:, t], dt[:, t], params.A, b[:, t], c[:, t], D=params.D,
                                             dt_bias=params.dt_bias, dt_limit=params.dt_limit))
            self.spec_states[layer][slots, t] = work
        return torch.stack(ys, dim=1)

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)
        if self._windows:
            for layer in range(self.layout.num_layers):
                self.ssm_state[layer][slots] = self.spec_states[layer][slots, num_accepted.long() - 1]

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def decode(
        self, layer: int, slots: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, params: MambaParams,
        conv_done: bool = False,
    ) -> torch.Tensor:
        if not conv_done:
            xbc = causal_conv1d_update(xbc, self.conv_state[layer], params.conv_weight, params.conv_bias, slots)
        x, b, c = self.layout.split_xbc(xbc)
        return selective_state_update(
            self.ssm_state[layer], x, dt, params.A, b, c, D=params.D, dt_bias=params.dt_bias,
            dt_limit=params.dt_limit, state_indices=slots,
        )
