"""Draft verification: greedy matching, and rejection sampling that preserves the target distribution."""

from __future__ import annotations

import math

import pytest
import torch

from replayserve.engine.sampler import SamplingBatch, filter_ref, sample, sample_tokens
from replayserve.sampling_params import SamplingParams
from replayserve.speculative.acceptance import (
    _rejection_accept_batch,
    accept_argmax,
    accept_drafts,
    greedy_accept,
    rejection_accept,
)

# Chi-square critical value for df = 5 (V = 6) at alpha = 0.001: 20.515 (standard chi-square table).
CHI2_CRIT_DF5_ALPHA_001 = 20.515
N = 40000  # enough that moving 2% of one token's mass gives a statistic far above the critical value

P = torch.tensor(
    [
        [0.30, 0.25, 0.15, 0.12, 0.10, 0.08],
        [0.05, 0.10, 0.40, 0.20, 0.15, 0.10],
        [0.10, 0.20, 0.10, 0.20, 0.20, 0.20],
    ],
    dtype=torch.float64,
)
Q = torch.tensor(
    [
        [0.10, 0.30, 0.25, 0.05, 0.20, 0.10],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
    ],
    dtype=torch.float64,
)


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit statistic of integer samples (n,) against probabilities (V,)."""
    counts = torch.bincount(samples, minlength=probs.numel()).to(torch.float64)
    expected = samples.numel() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def _shift(probs: torch.Tensor, src: int, dst: int, amount: float = 0.02) -> torch.Tensor:
    """probs with `amount` of absolute mass moved from token src to token dst (still a distribution)."""
    shifted = probs.clone()
    shifted[src] -= amount
    shifted[dst] += amount
    return shifted


def _emitted(drafts: torch.Tensor, accepted: torch.Tensor, token: torch.Tensor, i: int) -> tuple[torch.Tensor, ...]:
    """(mask, values): rows that emit an i-th token (all earlier drafts accepted) and that token."""
    mask = accepted >= i
    values = torch.where(accepted > i, drafts[:, i] if i < drafts.shape[1] else token, token)
    return mask, values[mask]


# ---------------------------------------------------------------------------------------------- greedy


def _logits_for(argmaxes: list[int], vocab: int = 8) -> torch.Tensor:
    logits = torch.randn(len(argmaxes), vocab, generator=torch.Generator().manual_seed(0))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def test_greedy_all_accepted_emits_the_bonus_token() -> None:
    assert greedy_accept(_logits_for([3, 1, 4, 6]), [3, 1, 4]) == [3, 1, 4, 6]


def test_greedy_first_draft_rejected() -> None:
    assert greedy_accept(_logits_for([3, 1, 4, 6]), [2, 1, 4]) == [3]


def test_greedy_middle_rejection_stops_there() -> None:
    # Drafts after the mismatch are not looked at, even where they happen to match.
    assert greedy_accept(_logits_for([3, 1, 4, 6]), [3, 5, 4]) == [3, 1]


def test_greedy_no_drafts_emits_one_token() -> None:
    assert greedy_accept(_logits_for([5]), []) == [5]


def test_greedy_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError, match="len\\(drafts\\) \\+ 1"):
        greedy_accept(_logits_for([3, 1]), [3, 1])


def test_accept_argmax_matches_greedy_accept_on_random_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    for _ in range(50):
        k = int(torch.randint(0, 5, (1,), generator=gen))
        logits = torch.randn(k + 1, 4, generator=gen)
        drafts = torch.randint(0, 4, (k,), generator=gen).tolist()
        assert accept_argmax(logits.argmax(-1).tolist(), drafts) == greedy_accept(logits, drafts)
    with pytest.raises(ValueError, match="len\\(drafts\\) \\+ 1"):
        accept_argmax([3], [3])


# ---------------------------------------------------------------------------------------------- rejection


def test_rejection_identical_distributions_accept_every_draft() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        probs = torch.rand(4, 10, generator=gen).softmax(-1)
        drafts = torch.multinomial(probs[:3], 1, generator=gen)[:, 0].tolist()
        emitted = rejection_accept(probs, drafts, probs[:3].clone(), generator=gen)
        assert emitted[:3] == drafts and len(emitted) == 4


def test_rejection_preserves_the_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1234)
    drafts = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=gen) for i in range(2)], dim=1)
    accepted, token = _rejection_accept_batch(P.expand(N, 3, 6), drafts, Q.expand(N, 2, 6), generator=gen)

    _, first = _emitted(drafts, accepted, token, 0)
    mask, second = _emitted(drafts, accepted, token, 1)
    assert mask.sum() > 0.7 * N  # sum(min(p_0, q_0)) = 0.73 of rows accept the first draft
    _, bonus = _emitted(drafts, accepted, token, 2)
    assert _chi2(first, P[0]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(second, P[1]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(bonus, P[2]) < CHI2_CRIT_DF5_ALPHA_001
    # Power: the same samples against a target with 2% of one token's mass moved must fail the test,
    # so the checks above could have failed.
    assert _chi2(first, _shift(P[0], 1, 0)) > CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(second, _shift(P[1], 3, 2)) > CHI2_CRIT_DF5_ALPHA_001
    # And the drafts alone (q) are far from p: the rejection step is doing the work.
    assert _chi2(drafts[:, 0], P[0]) > CHI2_CRIT_DF5_ALPHA_001


def test_rejection_deterministic_drafts_accept_at_the_target_probability() -> None:
    gen = torch.Generator().manual_seed(7)
    drafts = torch.tensor([2, 4]).expand(N, 2)
    accepted, token = _rejection_accept_batch(P.expand(N, 3, 6), drafts, None, generator=gen)
    rate0 = float((accepted >= 1).double().mean())
    assert abs(rate0 - float(P[0, 2])) < 5 * math.sqrt(float(P[0, 2] * (1 - P[0, 2])) / N)
    given = accepted >= 1
    rate1 = float((accepted[given] >= 2).double().mean())
    n1 = int(given.sum())
    assert abs(rate1 - float(P[1, 4])) < 5 * math.sqrt(float(P[1, 4] * (1 - P[1, 4])) / n1)
    # One-hot drafts are lossless too: the first emitted token follows p_0.
    _, first = _emitted(drafts, accepted, token, 0)
    assert _chi2(first, P[0]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(first, _shift(P[0], 1, 0)) > CHI2_CRIT_DF5_ALPHA_001


def test_rejection_single_row_acceptance_rate_with_deterministic_drafts() -> None:
    gen = torch.Generator().manual_seed(3)
    n = 2000
    hits = sum(rejection_accept(P[:2], [2], None, generator=gen)[0] == 2 for _ in range(n))
    # Emitting 2 first happens by acceptance (p_0(2)) or never: the residual excludes the draft.
    assert abs(hits / n - float(P[0, 2])) < 5 * math.sqrt(float(P[0, 2] * (1 - P[0, 2])) / n)


def test_rejection_single_row_matches_the_batched_helper_and_is_seeded() -> None:
    for seed in range(20):
        drafts = [1, 2]
        one = rejection_accept(P, drafts, Q, generator=torch.Generator().manual_seed(seed))
        again = rejection_accept(P, drafts, Q, generator=torch.Generator().manual_seed(seed))
        accepted, token = _rejection_accept_batch(
            P[None], torch.tensor([drafts]), Q[None], generator=torch.Generator().manual_seed(seed)
        )
        assert one == again == [*drafts[: int(accepted[0])], int(token[0])]


def test_rejection_no_drafts_samples_the_bonus_from_p0() -> None:
    probs = torch.zeros(1, 5, dtype=torch.float64)
    probs[0, 3] = 1.0
    assert rejection_accept(probs, [], None) == [3]
    assert rejection_accept(probs, [], torch.zeros(0, 5)) == [3]


def test_rejection_zero_draft_probability_always_accepts() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.0, 1.0]])
    q = torch.tensor([[1.0, 0.0, 0.0]])  # the draft 1 has q == 0 < p
    for seed in range(50):
        assert rejection_accept(p, [1], q, generator=torch.Generator().manual_seed(seed)) == [1, 2]


def test_rejection_zero_target_probability_always_rejects() -> None:
    p = torch.tensor([[0.5, 0.0, 0.5], [1.0, 0.0, 0.0]])
    for seed in range(50):
        gen = torch.Generator().manual_seed(seed)
        assert rejection_accept(p, [1], torch.tensor([[0.2, 0.6, 0.2]]), generator=gen)[0] in (0, 2)
        assert rejection_accept(p, [1], None, generator=gen)[0] in (0, 2)


def test_rejection_empty_residual_falls_back_to_p() -> None:
    # q dominates p everywhere (q here is not normalised), so a rejection leaves max(p - q, 0) == 0.
    p = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    q = torch.tensor([[0.5, 1.0]])
    results = [rejection_accept(p, [1], q, generator=torch.Generator().manual_seed(s)) for s in range(60)]
    rejected = [r for r in results if len(r) == 1]
    assert rejected and len(rejected) < len(results)
    assert all(r[0] in (0, 1) for r in rejected)


def test_rejection_tiny_probabilities_do_not_flip_decisions() -> None:
    # p(d) == q(d) at a half-precision subnormal must accept for every uniform draw.
    p = torch.tensor([[6e-8, 0.5, 0.5], [0.0, 1.0, 0.0]], dtype=torch.float16)
    for seed in range(50):
        assert rejection_accept(p, [0], p[:1].clone(), generator=torch.Generator().manual_seed(seed)) == [0, 1]


def test_rejection_rejects_bad_shapes_and_tokens() -> None:
    with pytest.raises(ValueError, match="target_probs of shape"):
        rejection_accept(P, [1], None)
    with pytest.raises(ValueError, match="drafts must have shape"):
        _rejection_accept_batch(P[None], torch.tensor([1, 2]), None)
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        rejection_accept(P, [1, 2], Q[:1])
    with pytest.raises(ValueError, match="draft tokens"):
        rejection_accept(P, [1, 6], None)
    with pytest.raises(ValueError, match="target_probs"):
        rejection_accept(P[0], [], None)


# ---------------------------------------------------------------------------------------------- batched


def _grid(lengths: list[int]) -> tuple[torch.Tensor, int]:
    width = max(lengths)
    return torch.tensor([r * width + j for r, n in enumerate(lengths) for j in range(n)]), width


def test_accept_drafts_counts_leading_matches_per_row() -> None:
    # Rows: 2 drafts (both match), 3 drafts (second mismatches), plain, 1 draft (mismatch).
    draws = torch.tensor([3, 1, 9, 5, 6, 5, 0, 4, 2, 8])
    drafts = torch.tensor([3, 1, -1, 5, 7, 5, -1, -1, 4, -1])
    grid, width = _grid([3, 4, 1, 2])
    assert accept_drafts(draws, drafts, grid, 4, width).tolist() == [2, 1, 0, 0]


def test_batched_greedy_verify_equals_the_per_row_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    ks = [int(k) for k in torch.randint(0, 5, (64,), generator=gen)]
    logits = torch.randn(sum(k + 1 for k in ks), 6, generator=gen, dtype=torch.float64)
    best = logits.argmax(-1)
    drafts, start = [], 0
    for k in ks:  # drafts that mostly follow the argmax, so long prefixes get accepted
        row = best[start : start + k].clone()
        row[torch.rand(k, generator=gen) < 0.25] = torch.randint(0, 6, (1,), generator=gen)
        drafts.append(tuple(row.tolist()))
        start += k + 1
    results = sample(logits, [SamplingParams(temperature=0.0)] * len(ks), [None] * len(ks), drafts)
    start = 0
    for k, d, r in zip(ks, drafts, results, strict=True):
        assert list(r.tokens) == greedy_accept(logits[start : start + k + 1], d)
        start += k + 1
    assert max(len(r.tokens) for r in results) == 5


def test_batched_rejection_is_lossless_with_deterministic_drafts() -> None:
    """The engine's verify path (`sample_tokens`) on N rows of fixed drafts (2, 4) against P: the
    tokens it emits at each position follow P, the drafts are accepted at the target's rate, and
    a 2% shift of one token's mass would be detected."""
    torch.manual_seed(11)
    logits = P.log().repeat(N, 1)
    params = [SamplingParams(temperature=1.0)] * N
    generators = [torch.Generator().manual_seed(i) if i % 5 == 0 else None for i in range(N)]
    batch = SamplingBatch.build(params, generators, [(2, 4)] * N, 6, torch.float64, logits.device)
    draws, accepted = sample_tokens(logits, batch)
    token = draws.view(N, 3).gather(1, accepted[:, None])[:, 0]
    drafts = torch.tensor([2, 4]).expand(N, 2)
    _, first = _emitted(drafts, accepted, token, 0)
    _, second = _emitted(drafts, accepted, token, 1)
    _, bonus = _emitted(drafts, accepted, token, 2)
    assert _chi2(first, P[0]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(second, P[1]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(bonus, P[2]) < CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(first, _shift(P[0], 1, 0)) > CHI2_CRIT_DF5_ALPHA_001
    assert _chi2(second, _shift(P[1], 3, 2)) > CHI2_CRIT_DF5_ALPHA_001
    # Acceptance at the target's own probability, as in the per-row reference.
    rate0 = float((accepted >= 1).double().mean())
    assert abs(rate0 - float(P[0, 2])) < 5 * math.sqrt(float(P[0, 2] * (1 - P[0, 2])) / N)
    given = accepted >= 1
    rate1 = float((accepted[given] >= 2).double().mean())
    assert abs(rate1 - float(P[1, 4])) < 5 * math.sqrt(float(P[1, 4] * (1 - P[1, 4])) / int(given.sum()))


def test_batched_rejection_is_lossless_against_the_filtered_target() -> None:
    # top-k = 4 and temperature 0.8: the first emitted token follows the filtered distribution,
    # drafting a token the filter removed (5) is never accepted.
    torch.manual_seed(12)
    p = SamplingParams(temperature=0.8, top_k=4)
    target = filter_ref(P[0].log(), p).softmax(-1)
    for draft in (0, 5):
        logits = P[:2].log().repeat(N, 1)
        batch = SamplingBatch.build([p] * N, [None] * N, [(draft,)] * N, 6, torch.float64, logits.device)
        draws, accepted = sample_tokens(logits, batch)
        first = torch.where(accepted == 1, draft, draws.view(N, 2)[:, 0])
        keep = target > 0
        counts = torch.bincount(first, minlength=6).double()
        assert counts[~keep].sum() == 0
        stat = float(((counts[keep] - N * target[keep]) ** 2 / (N * target[keep])).sum())
        assert stat < 16.266  # df = 3 at alpha = 0.001
        assert abs(float(accepted.double().mean()) - float(target[draft])) < 5 * math.sqrt(0.25 / N)
