"""Per-step metadata the model forward reads: one object, built by the runner for each step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from replayserve.ssm.packed_prefill import PrefillPlan


@dataclass(frozen=True)
class StepContext:
    """The flattened batch of one step.

    Sequences are ordered decodes first (one token each, or 1 + drafts for a speculative verify),
    then prefill chunks. Token tensors have T rows (all sequences' tokens concatenated); sequence
    tensors have S rows.

    positions: (T,) int64 absolute positions.
    slot_mapping: (T,) int64 flat KV slot (block * block_size + offset) of each token.
    query_start_loc: (S + 1,) int64 offsets of each sequence's tokens.
    seq_lens: (S,) int64 context length of each sequence after this step.
    block_tables: (S, max_blocks) int64 KV block ids, padded with -1.
    state_slots: (S,) int64 Mamba state slot of each sequence.
    query_lens, state_slot_list: host copies, so prefill loops need no device sync.
    prefill_captures: per prefill sequence, (offset, boundary slot) pairs: the state after the
        chunk's first `offset` tokens is copied there (prefix caching); empty when caching is off.
    prefill_starts: per prefill sequence, the absolute position of its first token (host).
    uniform_decode: W > 0 when every sequence is a decode row of W tokens whose block table has
        no -1 and whose slots are valid (padded rows point at a pad block and a pad state slot):
        layers then take their fixed-shape paths, which a CUDA graph can capture; 0 otherwise.
    decode_num_tokens: with uniform_decode, (S,) int32 real tokens of each row (<= W; the rest
        are padding whose outputs are dropped).
    row_slots: with uniform_decode, (S,) int64 each row's state slot, -1 on padded rows: what
        once-per-step state updates (ReplaySSM's cursors) take, so that they skip the padding.
    prefill_plan: the packed prefill kernels' metadata for `prefill_segments()`, built once per
        step by the runner and read by every Mamba layer; None without prefill or where the
        sequences run one by one (the reference path).
    """

    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    state_slots: torch.Tensor
    num_decodes: int
    query_lens: tuple[int, ...]
    state_slot_list: tuple[int, ...]
    prefill_captures: tuple[tuple[tuple[int, int], ...], ...] = ()
    prefill_starts: tuple[int, ...] = ()
    uniform_decode: int = 0
    decode_num_tokens: torch.Tensor | None = None
    row_slots: torch.Tensor | None = None
    prefill_plan: PrefillPlan | None = None
    # The step's RoPE cos / sin tables by (rotary dim, theta, dtype), made by the first attention
    # layer that needs them and read by the others (`layers.attention.Attention.attend`).
    rope_tables: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, compare=False,
                                                                        repr=False)

    @property
    def decode_lens(self) -> tuple[int, ...]:
        return self.query_lens[: self.num_decodes]

    @property
    def num_decode_tokens(self) -> int:
        return sum(self.decode_lens)

    def prefill_segments(self) -> list[tuple[int, int, int, tuple[tuple[int, int], ...], int]]:
        """(token start, token end, state slot, captures, first position) of each prefill sequence."""
        out = []
        start = self.num_decode_tokens
        lens, slots = self.query_lens[self.num_decodes :], self.state_slot_list[self.num_decodes :]
        captures = self.prefill_captures or ((),) * len(lens)
        firsts = self.prefill_starts or (0,) * len(lens)
        for qlen, slot, capture, first in zip(lens, slots, captures, firsts, strict=True):
            out.append((start, start + qlen, slot, capture, first))
            start += qlen
        return out
