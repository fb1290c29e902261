"""The layers whose tensor-parallel forward differs from the single-rank one: the vocab-parallel
embedding and LM head, the Mamba gated norm over groups split between ranks, and the all-reduce
after a row-parallel projection. Collectives run on the default process group (one per process:
distributed/group.py)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from replayserve.ops.dtypes import compute_dtype


def vocab_rows(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """(first token id, rows) of a rank's vocab shard: ceil(V / world) rows, the last rank's padded
    past V with zero rows (their logits are cut off after the gather)."""
    rows = math.ceil(vocab_size / world)
    return rank * rows, rows


class VocabParallelEmbedding(nn.Module):
    """`nn.Embedding` over a rank's rows of the vocabulary: ids of other ranks give zeros here, and
    the all-reduce adds each id's one non-zero row, so the sum is exact."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, world: int) -> None:
        super().__init__()
        self.start, rows = vocab_rows(vocab_size, rank, world)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids (...) int64 -> (..., hidden) in the weight dtype, the same on every rank."""
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[..., None], 0)
        dist.all_reduce(out)
        return out


class ParallelLMHead(nn.Module):
    """The LM head over a rank's vocab rows; every rank gathers the full logits (the sampler and
    prompt scoring then run unchanged, on rank 0 only)."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, world: int) -> None:
        super().__init__()
        self.vocab_size, self.world = vocab_size, world
        _, rows = vocab_rows(vocab_size, rank, world)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (S, hidden) -> logits (S, vocab_size) in the weight dtype."""
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world)]
        dist.all_gather(parts, local)
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


class ShardedGatedRMSNorm(nn.Module):
    """`GatedRMSNorm` when a rank's channels cut through the model's norm groups (ranks that do not
    divide n_groups): each group's sum of squares is added up over the ranks, then every channel is
    scaled by its group's rsqrt(mean + eps), as `gated_rms_norm_ref` computes it on one rank. With
    `norm_before_gate` (Falcon-H1's option) x is normed and then gated, as `gated_rms_norm_ref` with it."""

    def __init__(self, channels: int, first_channel: int, group_size: int, num_groups: int, eps: float,
                 norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.first_channel, self.group_size, self.num_groups, self.eps = first_channel, group_size, num_groups, eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z (T, channels) -> (T, channels), dtype as `gated_rms_norm_ref`."""
        cdt = compute_dtype(x.dtype)
        gate = F.silu(z.to(cdt))
        h = x.to(cdt) if self.norm_before_gate else x.to(cdt) * gate
        # Not a buffer: models are built on the meta device, and this is no checkpoint tensor.
        group_of = (torch.arange(h.shape[-1], device=h.device) + self.first_channel) // self.group_size
        sums = h.new_zeros(h.shape[0], self.num_groups).index_add_(1, group_of, h.square())
        dist.all_reduce(sums)
        scale = torch.rsqrt(sums / self.group_size + self.eps)
        if self.norm_before_gate:
            return (self.weight * (h * scale[:, group_of]) * gate).to(x.dtype)
        return self.weight * (h * scale[:, group_of]).to(x.dtype)


def all_reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    """Forward hook of a row-parallel projection (or a mixer ending in one): each rank's output is
    a partial sum over its slice of the input features; the hook keeps checkpoint names and the
    mixers' code free of parallelism."""
    dist.all_reduce(output)
    return output
