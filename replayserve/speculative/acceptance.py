"""Verification of draft tokens against the target model: greedy matching and lossless rejection sampling.

`accept_drafts` verifies a whole step's rows at once on the device (the engine's path); the per-row
functions after it are its references, and `rejection_accept` also covers drafts that come with a
proposal distribution.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def accept_drafts(draws: Tensor, drafts: Tensor, grid_index: Tensor, num_rows: int, width: int) -> Tensor:
    """Batched verification of deterministic drafts against tokens drawn from the target.

    A deterministic draft's proposal is one-hot, and rejection sampling against a one-hot proposal
    is: draw t ~ p_i (the filtered target after the prefix drafts[:i]); accept d_i iff t == d_i; at
    the first rejection emit t. It accepts with probability p_i(d_i), as rejection sampling does,
    and a rejected t is distributed as p_i with d_i's mass removed, renormalised: the residual
    max(p_i - onehot(d_i), 0). After k accepted drafts the draw at position k is the bonus token.
    With t = argmax p_i it is greedy prefix matching. Either way a row emits its draws at positions
    0..accepted, the accepted ones being equal to the drafts.

    Args:
        draws: (N,) int64, one token drawn from the target at every position, rows flattened in
            order (a row of k drafts has k + 1 positions).
        drafts: (N,) int64, the draft each position verifies; -1 (never drawn) at a row's last position.
        grid_index: (N,) int64, row * width + j at position j of a row.
        num_rows: R.
        width: at least the positions of the longest row.

    Returns:
        accepted: (R,) int64, the number of leading drafts of each row equal to their draws.
    """
    match = torch.zeros(num_rows * width, dtype=torch.int64, device=draws.device)
    match.index_copy_(0, grid_index, (draws == drafts).long())
    return match.view(num_rows, width).cumprod(dim=1).sum(dim=1)


def greedy_accept(target_logits: Tensor, drafts: Sequence[int]) -> list[int]:
    """Greedy verification of one row.

    Args:
        target_logits: (len(drafts) + 1, V), any float dtype; row i holds the target's logits for the
            token after the draft prefix drafts[:i].
        drafts: the proposed tokens.

    Returns:
        The emitted tokens: the longest prefix of drafts that equals the target argmax at each position,
        then one more token (the argmax at the first mismatch, or the bonus token after the last draft).
        Length = accepted + 1, always >= 1.
    """
    if target_logits.dim() != 2 or target_logits.shape[0] != len(drafts) + 1:
        raise ValueError(
            f"greedy_accept needs target_logits of shape (len(drafts) + 1, V) = ({len(drafts) + 1}, V), "
            f"got {tuple(target_logits.shape)}"
        )
    return accept_argmax(target_logits.argmax(dim=-1).tolist(), drafts)


def accept_argmax(best: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """``greedy_accept`` from the target's argmax per position (len(drafts) + 1 ids), so a batch of
    rows can move its argmaxes to the host at once."""
    if len(best) != len(drafts) + 1:
        raise ValueError(f"accept_argmax needs len(drafts) + 1 = {len(drafts) + 1} argmaxes, got {len(best)}")
    emitted: list[int] = []
    for draft, target in zip(drafts, best, strict=False):
        if draft != target:
            break
        emitted.append(draft)
    emitted.append(best[len(emitted)])
    return emitted


def rejection_accept(
    target_probs: Tensor,
    drafts: Sequence[int],
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Lossless speculative (rejection) sampling of one row (Leviathan et al. / Chen et al. 2023).

    For i in 0..k-1, drafts[i] is accepted with probability min(1, p_i(d) / q_i(d)); the first rejection
    emits a token from normalize(max(p_i - q_i, 0)) and stops; if all are accepted a bonus token is drawn
    from p_k. The emitted tokens are then distributed exactly as k + 1 tokens sampled from p, provided
    each draft was itself drawn from q_i.

    Args:
        target_probs: (k + 1, V) probabilities, already temperature / top-k / top-p processed by the caller.
        drafts: the k proposed tokens.
        draft_probs: (k, V) the proposer's distributions, or None for a deterministic proposer (one-hot on
            each draft).
        generator: used for every random draw, so a fixed seed reproduces the result.

    Returns:
        The emitted tokens, length accepted + 1.

    Edge cases: a residual that is all zeros (p == q exactly) samples from p_i instead; q_i(d) == 0 while
    p_i(d) > 0 counts as accept (ratio inf).
    """
    k = len(drafts)
    if target_probs.dim() != 2 or target_probs.shape[0] != k + 1:
        raise ValueError(
            f"rejection_accept needs target_probs of shape (k + 1, V) = ({k + 1}, V) for k = {k} drafts, "
            f"got {tuple(target_probs.shape)}"
        )
    if draft_probs is not None and draft_probs.dim() != 2:
        raise ValueError(f"rejection_accept needs draft_probs of shape (k, V) or None, got {tuple(draft_probs.shape)}")
    draft_ids = torch.tensor(list(drafts), dtype=torch.long, device=target_probs.device).reshape(1, k)
    accepted, token = _rejection_accept_batch(
        target_probs[None], draft_ids, None if draft_probs is None else draft_probs[None], generator
    )
    return [*drafts[: int(accepted[0])], int(token[0])]


def _rejection_accept_batch(
    target_probs: Tensor,
    drafts: Tensor,
    draft_probs: Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """rejection_accept over B independent rows at once (one call is one row of this).

    Args:
        target_probs: (B, k + 1, V) probabilities.
        drafts: (B, k) int64 draft tokens.
        draft_probs: (B, k, V) probabilities, or None for one-hot drafts.
        generator: used for every random draw.

    Returns:
        accepted: (B,) int64, how many leading drafts each row accepted.
        token: (B,) int64, the token emitted after them (the residual sample or the bonus token).
    """
    b, k1, vocab = target_probs.shape
    k = k1 - 1
    if drafts.shape != (b, k):
        raise ValueError(f"drafts must have shape (B, k) = ({b}, {k}) to match target_probs, got {tuple(drafts.shape)}")
    if draft_probs is not None and draft_probs.shape != (b, k, vocab):
        raise ValueError(f"draft_probs must have shape (B, k, V) = ({b}, {k}, {vocab}), got {tuple(draft_probs.shape)}")
    if k and not (0 <= int(drafts.min()) and int(drafts.max()) < vocab):
        raise ValueError(
            f"draft tokens must be in [0, {vocab}), got values in [{int(drafts.min())}, {int(drafts.max())}]"
        )
    # float64: ratios and residuals of tiny probabilities must not round to a different decision.
    p = target_probs.to(torch.float64)
    q = None if draft_probs is None else draft_probs.to(torch.float64)
    rows = torch.arange(b, device=p.device)
    p_draft = p[:, :k].gather(2, drafts[..., None])[..., 0]
    q_draft = torch.ones_like(p_draft) if q is None else q.gather(2, drafts[..., None])[..., 0]
    u = torch.rand((b, k), generator=generator, dtype=torch.float64, device=p.device)
    # u * q < p is u < p / q without the division: q == 0 < p always accepts, p == 0 always rejects.
    accept = u * q_draft < p_draft
    accepted = accept.long().cumprod(dim=1).sum(dim=1)
    p_next = p[rows, accepted]
    residual = p_next
    if k:
        rejected = accepted < k
        at = accepted.clamp(max=k - 1)
        if q is None:
            # max(p - onehot(d), 0) is p with the draft's entry removed.
            residual = p_next.clone()
            residual[rows[rejected], drafts[rows, at][rejected]] = 0.0
        else:
            residual = torch.where(rejected[:, None], (p_next - q[rows, at]).clamp(min=0.0), p_next)
        # p == q leaves nothing to redistribute; p itself is then the right distribution.
        residual = torch.where((residual.sum(dim=1) == 0)[:, None], p_next, residual)
    # multinomial normalises its weights, so the residual needs no explicit normalisation.
    token = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return accepted, token
