"""The MTP layers' greedy draft loop on the device: k drafts for a batch of rows, from device
tensors to device tensors, against the MTP cache (`models/mtp_kv.py`), with no host read inside
and shapes that depend only on the batch's rows, its new positions per row and k, so one CUDA
graph per (rows, width, k) can hold it."""

from __future__ import annotations

import torch
from torch import nn

from replayserve.models.mtp_kv import MTPKV, MTPCall


@torch.inference_mode()
def greedy_drafts(model: nn.Module, kv: MTPKV, hidden: torch.Tensor, ids: torch.Tensor, call: MTPCall,
                  num_drafts: int) -> torch.Tensor:
    """`num_drafts` greedy drafts per row from the MTP layers (`MTPProposer`'s chaining).

    Draft 1 runs the MTP stack over each row's new positions (`forward_cached` of `NemotronHMTP` or
    `QwenMTP`), attending to the cached ones before them; draft j + 1 feeds draft j's token and the
    stack's own output for it, one position per row at `end + j`, whose keys and values go into the
    cache too (the next call overwrites them: the proposer commits up to `end` only). Each pick is
    an argmax on the device.

    Args:
        kv: the MTP cache, updated in place.
        hidden: (B, T, hidden) the target's final hidden states of each row's new positions,
            left-padded (padding: any finite value).
        ids: (B, T) int64, the token each of those positions predicted (padding: any valid id).
        call: the rows' positions, bounds and cache rows (`MTPCall`); every real row's count >= 1.
        num_drafts: k >= 1.

    Returns:
        (B, k) int64 drafts, on hidden's device.
    """
    embed, mtp = model.backbone.embeddings, model.mtp
    out = mtp.forward_cached(embed(ids), hidden, kv, call)
    picks = [model.compute_logits(out).argmax(-1)]
    for step in range(1, num_drafts):
        out = mtp.forward_cached(embed(picks[-1])[:, None], out[:, None], kv, call.then(step))
        picks.append(model.compute_logits(out).argmax(-1))
    return torch.stack(picks, dim=1)
