"""The MTP layers' attention keys and values kept across proposer calls: a ring of the last `ring`
positions per cache row, and the steps an MTP attention block takes against it (write the new
positions, gather the row's ring, attend with a mask).

A call runs T new positions per row, left-padded: row b's real positions are
``end[b] - count[b] + 1 .. end[b]``, the T columns hold ``end[b] - T + 1 .. end[b]``. Position p
lives at ring index ``p % ring``; the proposer (`speculative/mtp_cache.py`) keeps which positions
of a row are valid and never asks for more than `ring` at once. A query at position q sees the
keys at positions ``lo[b] .. q`` (its row's lower bound, the MTP window's first position).

Every shape here depends only on (B, T) and the ring, and nothing is read back to the host, so a
CUDA graph can hold a call. Padding (a padded column, a padded row) writes its keys and values to
the scratch row (the last one), which no real row reads, and a padding query attends to every
gathered key, so its output stays finite (a row of -inf scores would make NaN, which the next
block would carry).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from replayserve.config import ATTENTION, ModelConfig


@dataclass
class MTPKV:
    """Per attention block of the MTP stack, keys and values (rows + 1, ring, Hkv, Dh): row `rows`
    is the scratch row padding writes to. RoPE (where the block has it) is applied to the keys."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def ring(self) -> int:
        return self.keys[0].shape[1]

    @property
    def scratch(self) -> int:
        return self.keys[0].shape[0] - 1

    @classmethod
    def empty(cls, cfg: ModelConfig, rows: int, ring: int, dtype: torch.dtype, device: torch.device) -> MTPKV:
        """Zeros (finite: a padding query may read any entry) for the attention blocks of `cfg`'s MTP
        stack, `rows` cache rows (and the scratch row) of `ring` positions."""
        shape = mtp_kv_shape(cfg, rows, ring)
        blocks = mtp_attention_blocks(cfg)
        return cls([torch.zeros(shape, dtype=dtype, device=device) for _ in range(blocks)],
                   [torch.zeros(shape, dtype=dtype, device=device) for _ in range(blocks)])


def mtp_attention_blocks(cfg: ModelConfig) -> int:
    """How many attention blocks the MTP stack has: the cache keeps keys and values for each."""
    return sum(t == ATTENTION for t in cfg.mtp_layer_types)


def mtp_kv_shape(cfg: ModelConfig, rows: int, ring: int) -> tuple[int, int, int, int]:
    """One block's keys (or values): (rows + 1, ring, Hkv, Dh); `cache/memory.py` counts the same."""
    return rows + 1, ring, cfg.num_key_value_heads, cfg.head_dim


@dataclass
class MTPCall:
    """Where a call's T new positions per row go. end, count, lo, rows: (B,) int64 on the device:
    each row's last new position, how many of its T columns are real (the rightmost; 0 for a
    padding row), the lowest position its queries see, and its cache row."""

    end: torch.Tensor
    count: torch.Tensor
    lo: torch.Tensor
    rows: torch.Tensor

    def positions(self, t: int) -> torch.Tensor:
        """(B, t) int64 absolute positions of the t columns."""
        return self.end[:, None] - t + 1 + torch.arange(t, device=self.end.device)

    def valid(self, t: int) -> torch.Tensor:
        """(B, t) bool: which columns are real."""
        return torch.arange(t, device=self.end.device) >= t - self.count[:, None]

    def then(self, step: int) -> MTPCall:
        """The call for the chained draft `step` positions after `end`: one real position per
        real row (padding rows stay padding)."""
        return MTPCall(self.end + step, self.count.clamp(max=1), self.lo, self.rows)


def write_kv(kv: MTPKV, block: int, call: MTPCall, k: torch.Tensor, v: torch.Tensor) -> None:
    """The call's new keys and values, k and v (B, T, Hkv, Dh) (RoPE applied where the block has
    it), into attention block `block`'s ring; padding into the scratch row."""
    t = k.shape[1]
    rows = torch.where(call.valid(t), call.rows[:, None], kv.scratch)
    index = call.positions(t) % kv.ring
    kv.keys[block][rows, index] = k
    kv.values[block][rows, index] = v


def cached_attention(q: torch.Tensor, kv: MTPKV, block: int, call: MTPCall, scale: float) -> torch.Tensor:
    """Attention from the queries of a call's last Tq columns to their rows' cached keys (the new
    ones written first, `write_kv`).

    Args:
        q: (B, Tq, H, Dh) queries (RoPE applied where the block has it).
        kv: the cache; block: which attention block of the stack.
        call: the rows' positions (`MTPCall`).
        scale: the softmax scale.

    Returns:
        (B, Tq, H, Dh) in q's dtype.
    """
    tq, ring = q.shape[1], kv.ring
    # The row's whole ring, ordered by position: the `ring` positions ending at `end`.
    key_pos = call.end[:, None] - ring + 1 + torch.arange(ring, device=q.device)  # (B, ring)
    src = torch.where(call.count > 0, call.rows, kv.scratch)[:, None]
    keys = kv.keys[block][src, key_pos % ring]  # (B, ring, Hkv, Dh)
    values = kv.values[block][src, key_pos % ring]
    query_pos = call.positions(tq)
    seen = (key_pos[:, None, :] <= query_pos[:, :, None]) & (key_pos[:, None, :] >= call.lo[:, None, None])
    mask = seen | ~call.valid(tq)[:, :, None]  # (B, Tq, ring)
    group = q.shape[2] // keys.shape[2]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2).repeat_interleave(group, dim=1),
                                         values.transpose(1, 2).repeat_interleave(group, dim=1),
                                         attn_mask=mask[:, None], scale=scale)
    return out.transpose(1, 2)
