"""Grammar token masks on the logits: a packed bitmask (bit t % 32 of word t // 32 set: token t is
allowed) per masked row, and the rows it masks; disallowed tokens' logits become -inf.

`apply_token_bitmask` runs xgrammar's kernels (`xgrammar.apply_token_bitmask_inplace`: C++ on the
CPU, Triton on CUDA) for float32, bfloat16 and float16 logits and `apply_token_bitmask_ref`, plain
PyTorch, for other dtypes (float64) or where xgrammar is absent. Either runs after the forward,
outside any CUDA graph: the bitmask is new every step, filled on the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class TokenMask(NamedTuple):
    """One step's grammar masks: bitmask (C, ceil(V / 32)) int32 on the host, row i masking the
    logits row positions[i] (C distinct positions among the step's sampled positions)."""

    bitmask: torch.Tensor
    positions: tuple[int, ...]


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Sets logits[rows[i], t] to -inf where bit t of bitmask[i] is 0, in place.

    Args:
        logits: (N, V) float, any device.
        bitmask: (C, ceil(V / 32)) int32 on the logits' device.
        rows: (C,) int64 distinct row indices into logits, on the logits' device; None: C = N, row i
            masks row i (the caller knows it on the host; comparing on the device would sync).
    """
    if logits.dtype not in _KERNEL_DTYPES:
        apply_token_bitmask_ref(logits, bitmask, rows)
        return
    try:
        import xgrammar as xgr
    except ImportError:
        apply_token_bitmask_ref(logits, bitmask, rows)
        return
    if rows is not None:
        # xgrammar's `indices` index the bitmask and the logits alike; ours are compact, so the
        # other rows get an all-allowed bitmask row (4 bytes per 32 tokens, not a copy of logits).
        full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=torch.int32, device=bitmask.device)
        bitmask = full.index_copy_(0, rows, bitmask)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """The plain-PyTorch oracle of `apply_token_bitmask` (same arguments), any float dtype."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    if rows is None:
        logits.masked_fill_(~allowed, -torch.inf)
    else:
        logits[rows] = logits[rows].masked_fill(~allowed, -torch.inf)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(C, ceil(V / 32)) int32 -> (C, V) bool: which tokens each row allows."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    return ((bitmask[:, :, None] >> shifts) & 1).reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()
