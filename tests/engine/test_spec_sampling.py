"""Stochastic speculative decoding keeps the target's distribution, end to end: on a model with an
8-token vocabulary, the joint distribution of the first two sampled tokens (the second one comes
out of a verify row with a fixed draft) matches the model's own, by a chi-square test at a fixed
seed. The draft is accepted at the rate the target gives it."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from replayserve.builtin.tiny import make_tiny
from replayserve.speculative.proposers import Proposer

PROMPT = [1, 5, 2, 7]
DRAFT = 3
V = 8


class FixedProposer(Proposer):
    """Always drafts the same token: a deterministic (one-hot) draft distribution."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        return [DRAFT][:k]


def chi2_critical(df: int, z: float = 3.0902) -> float:
    """Upper 0.001 quantile of chi-square with df degrees of freedom (Wilson-Hilferty; z is the
    standard normal's upper 0.001 quantile), within ~1% of the tables for df >= 5."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def _distribution(llm: LLM, prompt: list[int]) -> list[float]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=V),
                       use_tqdm=False)[0]
    probs = [0.0] * V
    for token, lp in out.logprobs[0].items():
        probs[token] = math.exp(lp.logprob)
    return probs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["baseline", "replay"])
def test_spec_sampling_matches_the_target_joint_distribution(tmp_path_factory: pytest.TempPathFactory,
                                                             backend: str) -> None:
    model_dir: Path = make_tiny(tmp_path_factory.mktemp("v8"), seed=0, layers="M*-", vocab_size=V)
    plain = LLM(model=str(model_dir), dtype="float64", device="cpu", max_num_seqs=1, max_model_len=16)
    p1 = _distribution(plain, PROMPT)
    p2 = [_distribution(plain, PROMPT + [t]) for t in range(V)]

    spec = LLM(model=str(model_dir), dtype="float64", device="cpu", max_num_seqs=256, max_model_len=16,
               ssm_backend=backend, replay_window=4,
               speculative={"method": "custom", "num_speculative_tokens": 1, "proposer": FixedProposer()})
    n, batch = 6144, 256
    counts: Counter[tuple[int, int]] = Counter()
    for start in range(0, n, batch):
        params = [SamplingParams(temperature=1.0, max_tokens=3, seed=start + i, ignore_eos=True)
                  for i in range(batch)]
        for out in spec.generate([{"prompt_token_ids": PROMPT}] * batch, params, use_tqdm=False):
            counts[(out.token_ids[0], out.token_ids[1])] += 1
    m = spec.get_metrics()
    assert m["spec_num_draft_tokens"] == n  # one verify row per request, after its prefill

    # Joint chi-square over (t1, t2); cells expecting fewer than 5 are pooled into one.
    expected = {(a, b): n * p1[a] * p2[a][b] for a in range(V) for b in range(V)}
    small = [c for c, e in expected.items() if e < 5]
    groups = [[c] for c, e in expected.items() if e >= 5] + [small]

    def chi2(want: dict[tuple[int, int], float]) -> float:
        return sum((sum(counts[c] for c in g) - sum(want[c] for c in g)) ** 2 / sum(want[c] for c in g)
                   for g in groups if sum(want[c] for c in g) > 0)

    critical = chi2_critical(len(groups) - 1)
    assert chi2(expected) < critical, f"chi-square {chi2(expected):.1f} over {len(groups)} cells"
    # Power: had the second token's distribution moved 5% of its mass from the draft to another
    # token (after the most likely first token), these samples would have shown it. (The 2% power
    # check is at the acceptance function's level, tests/speculative/test_acceptance.py, where 40k
    # samples are cheap.)
    a = max(range(V), key=lambda t: p1[t])
    other = max((t for t in range(V) if t != DRAFT), key=lambda t: p2[a][t])
    shifted = dict(expected)
    shifted[(a, DRAFT)] -= 0.05 * n * p1[a]
    shifted[(a, other)] += 0.05 * n * p1[a]
    assert chi2(shifted) > critical

    # The draft is kept with probability p(DRAFT | prompt, t1): the target's own probability.
    want = sum(p1[a] * p2[a][DRAFT] for a in range(V))
    got = m["spec_num_accepted_tokens"] / n
    assert abs(got - want) < 4 * math.sqrt(want * (1 - want) / n)
