"""The slot-level seam every recurrent-state backend shares (Mamba2's and Gated DeltaNet's).

The runner, the CUDA-graph decode path and prefix caching see a backend only through these
methods: zero a fresh request's slots, copy a cached state into a live slot, publish a decode
row's boundary state, and bracket each step (`begin_step` / `end_step`: a speculative verify
commits each row's accepted prefix). What a mixer calls to compute (prefill, decode, verify) is
the subclass's own (`backend.SSMBackend` for Mamba2, `gated_delta_backend.GatedDeltaBackend` for Gated
DeltaNet).

Both kinds hold per layer a conv state (slots, conv_dim, K - 1) and a recurrent state whose row
is one slot's (`ssm_state`), and with speculation the baseline's state after each verified token
(`spec_states`, (slots, T, ...) for Mamba2, (rows, T, ...) for Gated DeltaNet).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from replayserve.ops.copy_rows import copy_rows


class SlotLayout(Protocol):
    """What the slot-level methods read of a layout (`layout.MambaLayout`, `layout.GatedDeltaLayout`)."""

    @property
    def num_layers(self) -> int: ...

    @property
    def num_slots(self) -> int: ...

    @property
    def conv_kernel(self) -> int: ...

    @property
    def tokens_per_step(self) -> int: ...


class SlotStateBackend(ABC):
    """Owns the conv and recurrent state of every recurrent layer, indexed by state slot."""

    layout: SlotLayout
    conv_state: list[torch.Tensor]  # per layer, (slots, conv_dim, K - 1)
    ssm_state: list[torch.Tensor]  # per layer, (slots, ...) the recurrent state (the checkpoint for replay)
    spec_states: list[torch.Tensor]  # baseline verify: (slots or rows, T, ...), the state after each token
    # The last verify step's conv windows per layer and accepted counts, kept until the next step
    # so boundary states inside it can still be published.
    _windows: dict[int, torch.Tensor]
    _accepted: torch.Tensor | None

    def _init_step_state(self) -> None:
        self.spec_states, self._windows, self._accepted = [], {}, None
        self._capture_indices: dict[tuple, torch.Tensor] = {}

    @property
    def verify_windows(self) -> dict[int, torch.Tensor]:
        """The last verify step's conv windows by layer, (B, conv_dim, K - 1 + T) each (a new dict,
        the tensors shared): what a graphed step leaves behind on this object, which a CUDA graph's
        replay runs no Python to set (`DecodeGraphs` keeps it after a capture, restores it after a
        replay)."""
        return dict(self._windows)

    @verify_windows.setter
    def verify_windows(self, windows: dict[int, torch.Tensor]) -> None:
        self._windows = dict(windows)

    @abstractmethod
    def reset_slots(self, slots: torch.Tensor) -> None:
        """Zeroes every layer's state of `slots` (int64, on the device): a fresh request."""

    def copy_canonical(self, layer: int, src: int, dst: int) -> None:
        """One layer's conv and recurrent state of slot `src` into `dst` (src holds canonical state)."""
        self.conv_state[layer][dst] = self.conv_state[layer][src]
        self.ssm_state[layer][dst] = self.ssm_state[layer][src]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Every layer's state of canonical slots `src` into live slots `dst` (int64 (B,), on the
        device), which then continue from it as fresh slots: a prefix hit. One read and one write
        per row on CUDA (``copy_rows``), where ``t[dst] = t[src]`` would gather into a temporary."""
        for t in (*self.conv_state, *self.ssm_state):
            copy_rows(t, src, t, dst)

    def publish(self, rows: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, lag: torch.Tensor,
                A: list[torch.Tensor]) -> None:
        """After `end_step`: the canonical state at a block boundary `lag` committed tokens before
        the end of decode row `rows` (its live slot `src`) into boundary slot `dst` (all (M,) on the
        device; A: (H,) per Mamba layer, which ReplaySSM's materialization reads)."""
        if self._windows:  # a verify step: the boundary may lie inside it
            j, width = self._accepted[rows] - lag, self.layout.conv_kernel - 1  # j >= 1: tokens to the boundary
            for layer in range(self.layout.num_layers):
                self.conv_state[layer][dst] = conv_state_after(self._windows[layer][rows], j, width)
                self.ssm_state[layer][dst] = self._verified_state(layer, rows, src, j)
        else:  # plain decode: the live state is canonical after every step
            self.copy_slots(src, dst)

    def _verified_state(self, layer: int, rows: torch.Tensor, slots: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        """The last verify's state after the first j tokens of decode rows `rows` (their slots
        `slots`), (M, ...): `spec_states` is indexed by slot here (Mamba2's baseline)."""
        return self.spec_states[layer][slots, j.long() - 1]

    def begin_step(self, slots: torch.Tensor, num_tokens: torch.Tensor) -> None:
        """Before the forward: the decode rows' slots (B,) int64 and tokens per row (B,) int32."""
        self._windows = {}

    def end_step(self, slots: torch.Tensor, num_accepted: torch.Tensor) -> None:
        """After sampling, once per step for all layers: tokens kept per decode row (B,) int32."""
        self._accepted = num_accepted
        for layer, window in self._windows.items():
            self.conv_state[layer][slots] = conv_state_after(window, num_accepted, self.layout.conv_kernel - 1)

    def memory_bytes(self) -> int:
        """Bytes of all state tensors this backend allocated."""
        return sum(t.numel() * t.element_size() for t in self.state_tensors())

    @abstractmethod
    def state_tensors(self) -> list[torch.Tensor]:
        """Every tensor that holds per-slot state."""


def conv_state_after(window: torch.Tensor, j: torch.Tensor, width: int) -> torch.Tensor:
    """The conv state after each row's first j tokens: window (B, D, K-1+T), j (B,) -> (B, D, width)."""
    index = j.long()[:, None] + torch.arange(width, device=window.device)[None, :]
    return window.gather(2, index[:, None, :].expand(-1, window.shape[1], -1))
