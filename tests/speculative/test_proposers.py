"""Draft proposers: n-gram prompt lookup and the corruptible oracle used to drive acceptance in tests."""

from __future__ import annotations

import math
import random
import time

import pytest

from replayserve.speculative.proposers import NgramProposer, OracleProposer

# ---------------------------------------------------------------------------------------------- n-gram


def test_ngram_prefers_the_longest_matching_n() -> None:
    # Suffix [1, 2, 3]: the 3-gram recurs only at 0..2 (-> 7, 8); shorter n would match later occurrences.
    tokens = [1, 2, 3, 7, 8, 3, 9, 2, 3, 5, 1, 2, 3]
    assert NgramProposer(min_n=1, max_n=3).propose(tokens, 2) == [7, 8]
    assert NgramProposer(min_n=1, max_n=2).propose(tokens, 2) == [5, 1]  # [2, 3] most recently at 7..8
    assert NgramProposer(min_n=1, max_n=1).propose(tokens, 2) == [5, 1]  # [3] most recently at 8


def test_ngram_uses_the_most_recent_occurrence() -> None:
    tokens = [4, 5, 10, 11, 4, 5, 20, 21, 4, 5]
    assert NgramProposer(min_n=2, max_n=2).propose(tokens, 2) == [20, 21]


def test_ngram_truncates_at_the_end_of_the_sequence() -> None:
    # The most recent occurrence of [6] overlaps the suffix and is followed by a single token.
    assert NgramProposer(min_n=1, max_n=1).propose([1, 6, 2, 6, 6], 4) == [6]
    assert NgramProposer(min_n=2, max_n=2).propose([0, 1, 2, 8, 1, 2], 5) == [8, 1, 2]


def test_ngram_never_matches_the_suffix_itself() -> None:
    assert NgramProposer(min_n=1, max_n=3).propose([1, 2, 3], 3) == []
    assert NgramProposer(min_n=1, max_n=3).propose([7], 3) == []
    assert NgramProposer().propose([], 3) == []


def test_ngram_falls_back_to_shorter_n_and_respects_min_n() -> None:
    tokens = [9, 3, 4, 1, 2, 3]  # only the 1-gram [3] recurs
    assert NgramProposer(min_n=1, max_n=3).propose(tokens, 2) == [4, 1]
    assert NgramProposer(min_n=2, max_n=3).propose(tokens, 2) == []


@pytest.mark.parametrize("k", [0, -1])
def test_ngram_non_positive_k_proposes_nothing(k: int) -> None:
    assert NgramProposer().propose([1, 2, 1, 2], k) == []


@pytest.mark.parametrize(("min_n", "max_n"), [(0, 3), (3, 2), (-1, 1)])
def test_ngram_rejects_bad_n_range(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match="min_n"):
        NgramProposer(min_n=min_n, max_n=max_n)


def test_ngram_long_sequence_is_fast_and_correct() -> None:
    rng = random.Random(0)
    tokens = [rng.randrange(50) for _ in range(4000)]
    tokens += tokens[1000:1003]  # the 3-gram first seen at 1000 (and perhaps by chance elsewhere)
    proposer = NgramProposer(min_n=1, max_n=3)
    drafts = proposer.propose(tokens, 5)
    last = max(i for i in range(len(tokens) - 3) if tokens[i : i + 3] == tokens[-3:])
    assert drafts == tokens[last + 3 : last + 8]
    # A suffix that only matches as a 1-gram, after failing 3- and 2-grams across the whole sequence.
    worst = [5] * 3998 + [7, 5]
    start = time.perf_counter()
    for _ in range(50):
        proposer.propose(tokens, 5)
        proposer.propose(worst, 5)
    assert time.perf_counter() - start < 0.5


# ---------------------------------------------------------------------------------------------- oracle

PROMPT = (3, 1, 4)
CONTINUATION = [1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
VOCAB = 16


def _oracle(p: float, seed: int = 0) -> OracleProposer:
    return OracleProposer({PROMPT: CONTINUATION}, corrupt_prob=p, vocab_size=VOCAB, seed=seed)


def test_oracle_without_corruption_is_the_continuation() -> None:
    oracle = _oracle(0.0)
    assert oracle.propose(PROMPT, 4) == CONTINUATION[:4]
    assert oracle.propose([*PROMPT, *CONTINUATION[:5]], 3) == CONTINUATION[5:8]
    assert oracle.propose([*PROMPT, *CONTINUATION[:10]], 5) == CONTINUATION[10:]  # runs out
    assert oracle.propose([*PROMPT, *CONTINUATION], 5) == []
    assert oracle.propose(PROMPT, 0) == []


def test_oracle_full_corruption_changes_every_token() -> None:
    oracle = _oracle(1.0)
    for pos in range(len(CONTINUATION)):
        drafts = oracle.propose([*PROMPT, *CONTINUATION[:pos]], 3)
        assert len(drafts) == min(3, len(CONTINUATION) - pos)
        for d, c in zip(drafts, CONTINUATION[pos:], strict=False):
            assert d != c and 0 <= d < VOCAB
    # Over many positions of a small vocabulary every other token shows up as a replacement.
    long = OracleProposer({PROMPT: [0] * 400}, corrupt_prob=1.0, vocab_size=4)
    assert set(long.propose(PROMPT, 400)) == {1, 2, 3}


def test_oracle_corruption_rate_matches_corrupt_prob() -> None:
    p, n = 0.3, 20000
    oracle = OracleProposer({PROMPT: [0] * n}, corrupt_prob=p, vocab_size=VOCAB, seed=5)
    rate = sum(oracle.is_corrupted(PROMPT, j) for j in range(n)) / n
    assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_oracle_is_corrupted_agrees_with_propose() -> None:
    oracle = _oracle(0.5, seed=3)
    drafts = oracle.propose([*PROMPT, *CONTINUATION[:2]], 10)
    flags = [oracle.is_corrupted(PROMPT, j) for j in range(2, 12)]
    assert [d != c for d, c in zip(drafts, CONTINUATION[2:], strict=True)] == flags
    assert any(flags) and not all(flags)  # seed 3 mixes both, so both branches are checked


def test_oracle_is_deterministic_across_instances_and_seeded() -> None:
    tokens = [*PROMPT, *CONTINUATION[:1]]
    assert _oracle(0.5, seed=1).propose(tokens, 11) == _oracle(0.5, seed=1).propose(tokens, 11)
    flags = [[_oracle(0.5, seed=s).is_corrupted(PROMPT, j) for j in range(12)] for s in range(4)]
    assert len({tuple(f) for f in flags}) > 1


def test_oracle_diverged_outputs_propose_nothing() -> None:
    oracle = _oracle(0.0)
    wrong = (CONTINUATION[1] + 1) % VOCAB
    assert oracle.propose([*PROMPT, CONTINUATION[0], wrong], 3) == []
    assert oracle.propose([9, 9, 9], 3) == []  # no known prompt


def test_oracle_picks_the_longest_prompt_prefix() -> None:
    oracle = OracleProposer({(1, 2): [10, 11, 12], (1, 2, 3): [20, 21]}, corrupt_prob=0.0, vocab_size=32)
    assert oracle.propose([1, 2, 3], 2) == [20, 21]
    assert oracle.propose([1, 2], 2) == [10, 11]
    assert oracle.propose([1, 2, 10], 2) == [11, 12]


@pytest.mark.parametrize(("p", "vocab"), [(-0.1, 8), (1.5, 8), (0.5, 1)])
def test_oracle_rejects_bad_arguments(p: float, vocab: int) -> None:
    with pytest.raises(ValueError, match="OracleProposer"):
        OracleProposer({PROMPT: CONTINUATION}, corrupt_prob=p, vocab_size=vocab)
