"""The baseline Gated DeltaNet state backend: every step reads and writes the full (Hv, K, V) state.

Prefill is the shared chunked one (`gated_delta_backend`). Decode is `gated_delta_step`, in place on
the pool; a verify is `gated_delta_verify`, which leaves the pool alone and keeps the state after
every token in `spec_states` (indexed by the step's row, not by slot: the op writes them where it
runs, and only max_num_seqs rows need room, not every boundary slot); `end_step` copies each row's
accepted one into its slot. The ops are the Triton kernels on
CUDA and the token-by-token references elsewhere (float64 included).
"""

from __future__ import annotations

import torch

from replayserve.ops.conv1d import causal_conv1d_update, causal_conv1d_verify
from replayserve.ops.copy_rows import copy_rows
from replayserve.ops.dispatch import use_triton
from replayserve.ops.gated_delta import gated_delta_step, gated_delta_verify
from replayserve.ssm.gated_delta_backend import GatedDeltaBackend
from replayserve.ssm.layout import GatedDeltaLayout


class GatedDeltaBaselineBackend(GatedDeltaBackend):
    def __init__(self, layout: GatedDeltaLayout, device: torch.device) -> None:
        super().__init__(layout, device)
        if layout.tokens_per_step > 1:  # speculation: one state per verified position of each row
            self.spec_states = self._pool(layout.spec_states_shape, layout.state_dtype)

    def state_tensors(self) -> list[torch.Tensor]:
        return self.conv_state + self.ssm_state + self.spec_states

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)
        if self._windows:  # a verify step: each row continues from the state after its accepted tokens
            rows = torch.arange(slots.shape[0], device=slots.device)
            for layer in range(self.layout.num_layers):
                copy_rows(self._spec_rows(layer), self._spec_index(rows, num_accepted), self.ssm_state[layer], slots)

    def _verified_state(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        return self._spec_rows(layer)[self._spec_index(rows, j)]

    def _spec_rows(self, layer: int) -> torch.Tensor:
        """spec_states[layer] as (slots * T, Hv, K, V): row b's state after token t at b * T + t."""
        return self.spec_states[layer].flatten(0, 1)

    def _spec_index(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """Where the state after each row's first `kept` tokens is in `_spec_rows`, (B,) int64."""
        return rows.long() * self.layout.tokens_per_step + kept.long() - 1

    def _rule_slots(self, slots: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """The references need distinct slots: padded rows (the pad slot) become -1 there. The
        kernels run those rows on the pad slot, harmlessly, with no extra launch."""
        return slots if use_triton(state, None) else slots.masked_fill(slots == self._pad_slot, -1)

    def decode(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               conv_weight: torch.Tensor) -> torch.Tensor:
        mixed = causal_conv1d_update(qkv, self.conv_state[layer], conv_weight, None, slots)
        q, k, v = self.layout.split_qkv(mixed)
        state = self.ssm_state[layer]
        return gated_delta_step(state, q, k, v, g, beta, self._rule_slots(slots, state), use_qk_l2norm=True)

    def verify(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               num_tokens: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Padded tokens run too; their states are never kept."""
        mixed, self._windows[layer] = causal_conv1d_verify(qkv, self.conv_state[layer], conv_weight, None, slots)
        q, k, v = self.layout.split_qkv(mixed)
        rows, tokens = qkv.shape[:2]
        state = self.ssm_state[layer]
        return gated_delta_verify(state, q, k, v, g, beta, self._rule_slots(slots, state),
                                  out_states=self.spec_states[layer][:rows, :tokens], use_qk_l2norm=True)
