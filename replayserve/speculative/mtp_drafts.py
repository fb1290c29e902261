"""The MTP layers' greedy draft loop on the device: k drafts for a batch of rows, from device
tensors to device tensors, with no host read inside and shapes that depend only on the batch's
size, its window width and k, so one CUDA graph per (rows, width, k) can hold it."""

from __future__ import annotations

import torch
from torch import nn


@torch.inference_mode()
def greedy_drafts(model: nn.Module, hidden: torch.Tensor, ids: torch.Tensor, valid: torch.Tensor,
                  num_drafts: int) -> torch.Tensor:
    """`num_drafts` greedy drafts per row from the MTP layers (`MTPProposer`'s chaining).

    Draft 1 runs the MTP stack over each row's window (`forward_padded` of `NemotronHMTP` or `QwenMTP`); draft j + 1
    feeds draft j's token and the stack's own output for it, one position per row against the
    keys and values kept from the positions before. Each pick is an argmax on the device.

    Args:
        hidden: (B, W, hidden) the target's final hidden states of each row's last W computed
            positions, left-padded (padding: any finite value).
        ids: (B, W) int64, the token each of those positions predicted (padding: any valid id).
        valid: (B, W) bool, which positions are real; every row's last one must be.
        num_drafts: k >= 1.

    Returns:
        (B, k) int64 drafts, on hidden's device.
    """
    embed, mtp = model.backbone.embeddings, model.mtp
    out, cache = mtp.forward_padded(embed(ids), hidden, valid)
    picks = [model.compute_logits(out).argmax(-1)]
    # Every draft position is real: one mask made once, reused by each later draft.
    new = torch.ones_like(valid[:, :1])
    for _ in range(num_drafts - 1):
        out, cache = mtp.forward_padded(embed(picks[-1])[:, None], out[:, None], new, cache)
        picks.append(model.compute_logits(out).argmax(-1))
    return torch.stack(picks, dim=1)
