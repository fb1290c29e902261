"""The baseline Gated DeltaNet state backend: every step reads and writes the full (Hv, K, V) state.

The slot-level methods the runner, the CUDA-graph path and prefix caching call are
`SlotStateBackend`'s, as for Mamba2. The mixer calls `prefill_batch` (packed prefill segments,
each with its boundary captures), `decode` (one token per row) and `verify` (up to T tokens per row
from the live state, committing nothing: `end_step` keeps each row's accepted prefix, from the
state kept after every verified token). Every recurrence runs `gated_delta_recurrent_ref`, the
token-by-token rule: the faster ops (chunked prefill, Triton decode) replace it call for call.

Inputs are the conv's inputs `qkv` (q, k and v concatenated, pre-conv, pre-L2-norm) with the
log-space decay `g` and the write strength `beta` already computed by the mixer; outputs are the
rule's `o` per value head, before the gated norm.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replayserve.ops.conv1d import causal_conv1d_ref, causal_conv1d_update, causal_conv1d_verify
from replayserve.ops.gated_delta import gated_delta_recurrent_ref
from replayserve.ssm.layout import GatedDeltaLayout
from replayserve.ssm.params import Segment
from replayserve.ssm.slot_state import SlotStateBackend


class GatedDeltaBaselineBackend(SlotStateBackend):
    layout: GatedDeltaLayout

    def __init__(self, layout: GatedDeltaLayout, device: torch.device) -> None:
        self.layout = layout
        # Zero-initialised so padded or never-used slots hold finite values.
        self.conv_state = [torch.zeros(layout.conv_state_shape, dtype=layout.act_dtype, device=device)
                           for _ in range(layout.num_layers)]
        self.ssm_state = [torch.zeros(layout.ssm_state_shape, dtype=layout.state_dtype, device=device)
                          for _ in range(layout.num_layers)]
        self._init_step_state()
        if layout.tokens_per_step > 1:  # speculation: one state per verified position
            shape = (layout.num_slots, layout.tokens_per_step, *layout.ssm_state_shape[1:])
            self.spec_states = [torch.zeros(shape, dtype=layout.state_dtype, device=device)
                                for _ in range(layout.num_layers)]

    def state_tensors(self) -> list[torch.Tensor]:
        return self.conv_state + self.ssm_state + self.spec_states

    def reset_slots(self, slots: torch.Tensor) -> None:
        for t in self.state_tensors():
            t.index_fill_(0, slots, 0)

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        super().end_step(slots, num_accepted)
        if self._windows:  # a verify step: each row continues from the state after its accepted tokens
            for layer in range(self.layout.num_layers):
                self.ssm_state[layer][slots] = self.spec_states[layer][slots, num_accepted.long() - 1]

    def _rule(self, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The delta rule over post-conv qkv (B, T, conv_dim), g and beta (B, T, Hv) from state
        (B, Hv, K, V): o (B, T, Hv, V) and the final state, in the state dtype."""
        q, k, v = self.layout.split_qkv(qkv)
        o, final = gated_delta_recurrent_ref(q, k, v, g, beta, initial_state=state, use_qk_l2norm=True)
        return o, final.to(self.layout.state_dtype)

    def prefill_batch(self, layer: int, segments: Sequence[Segment], qkv: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Every prefill sequence of a step, each as `prefill` runs it.

        segments: ``StepContext.prefill_segments()``, contiguous; qkv (T, conv_dim), g and beta
        (T, Hv) the whole step's tokens. Returns o (hi - lo, Hv, V) for the segments' tokens
        lo = segments[0][0] to hi = segments[-1][1].
        """
        outs = [self.prefill(layer, slot, qkv[start:end], g[start:end], beta[start:end], conv_weight, captures)
                for start, end, slot, captures, _ in segments]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def prefill(self, layer: int, slot: int, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                conv_weight: torch.Tensor, captures: tuple[tuple[int, int], ...] = ()) -> torch.Tensor:
        """One sequence's prefill chunk from the state in `slot`, which then holds the state after it.

        qkv: (L, conv_dim) pre-conv; g, beta: (L, Hv); conv_weight: (conv_dim, K_conv). Returns o
        (L, Hv, V). captures: (offset, boundary slot) pairs, ascending, 0 < offset <= L: the state
        after the chunk's first `offset` tokens is also written into that slot (prefix caching).
        """
        conv_state, ssm_state = self.conv_state[layer], self.ssm_state[layer]
        width = conv_state.shape[-1]
        # The conv state after `o` tokens is the K_conv - 1 inputs before position o.
        inputs = torch.cat([conv_state[slot].T.to(qkv.dtype), qkv]) if captures else None
        mixed, conv_state[slot] = causal_conv1d_ref(qkv, conv_weight, None, conv_state[slot])
        outs, begin, state = [], 0, ssm_state[slot][None]
        # The rule runs up to each capture, then on: the states between are the boundaries'.
        for end in [o for o, _ in captures if o < qkv.shape[0]] + [qkv.shape[0]]:
            if end > begin:
                o, state = self._rule(mixed[None, begin:end], g[None, begin:end], beta[None, begin:end], state)
                outs.append(o[0])
            for offset, dst in captures:
                if offset == end:
                    conv_state[dst] = inputs[offset : offset + width].T
                    ssm_state[dst] = state[0]
            begin = end
        ssm_state[slot] = state[0]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def decode(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               conv_weight: torch.Tensor) -> torch.Tensor:
        """Advances each row's slot by one token: slots (B,) int64, qkv (B, conv_dim) pre-conv,
        g and beta (B, Hv). Returns o (B, Hv, V)."""
        mixed = causal_conv1d_update(qkv, self.conv_state[layer], conv_weight, None, slots)
        o, self.ssm_state[layer][slots] = self._rule(mixed[:, None], g[:, None], beta[:, None],
                                                     self.ssm_state[layer][slots])
        return o[:, 0]

    def verify(self, layer: int, slots: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               num_tokens: torch.Tensor, conv_weight: torch.Tensor) -> torch.Tensor:
        """Rows of up to T tokens from their live state (a speculative verify), committing
        nothing: `end_step` keeps each row's accepted prefix. qkv (B, T, conv_dim), g and beta
        (B, T, Hv) padded; num_tokens (B,) int32. Returns o (B, T, Hv, V)."""
        mixed, self._windows[layer] = causal_conv1d_verify(qkv, self.conv_state[layer], conv_weight, None, slots)
        state, outs = self.ssm_state[layer][slots], []
        for t in range(qkv.shape[1]):  # padded tokens run too; their states are never kept
            o, state = self._rule(mixed[:, t : t + 1], g[:, t : t + 1], beta[:, t : t + 1], state)
            self.spec_states[layer][slots, t] = state
            outs.append(o[:, 0])
        return torch.stack(outs, dim=1)
