"""Sampling parameters and stop rules, end to end through LLM.generate."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.engine.sampler import sample
from tests.conftest import assert_pools_full

PROMPT = {"prompt_token_ids": [10, 11, 12, 13, 14, 15]}


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=8)


def _greedy(llm: LLM, n: int = 12) -> list[int]:
    return llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), use_tqdm=False)[
        0
    ].token_ids


def test_seeded_sampling_is_reproducible_and_independent_of_batch(llm: LLM) -> None:
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(PROMPT, p, use_tqdm=False)[0].token_ids
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2, 3)]
    batch = llm.generate([PROMPT] * 4, [others[0], p, others[1], others[2]], use_tqdm=False)
    assert batch[1].token_ids == alone
    assert len({tuple(o.token_ids) for o in batch}) > 1, "different seeds should give different samples"


def test_top_k_one_and_tiny_top_p_are_greedy(llm: LLM) -> None:
    greedy = _greedy(llm)
    for p in (SamplingParams(temperature=1.5, top_k=1, seed=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.5, top_p=1e-9, seed=0, max_tokens=12, ignore_eos=True)):
        assert llm.generate(PROMPT, p, use_tqdm=False)[0].token_ids == greedy


def test_logprobs_are_top_k_of_the_model_distribution(llm: LLM) -> None:
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    assert len(out.logprobs) == 5
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert len(lp) == 3 and token in lp  # greedy: the sampled token is the top-1
        assert lp[token] == max(lp.values()) and all(v <= 0 for v in lp.values())
        assert sum(math.exp(v) for v in lp.values()) <= 1 + 1e-12


def test_stop_token_ids_eos_and_max_tokens(llm: LLM) -> None:
    greedy = _greedy(llm)
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]),
                       use_tqdm=False)[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == greedy[:3] and out.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    greedy = _greedy(llm)
    # Make the model's own 3rd greedy token the EOS token.
    object.__setattr__(llm.engine.config.model, "eos_token_ids", (greedy[2],))
    first = greedy.index(greedy[2])
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0]
    assert out.token_ids == greedy[: first + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == greedy


def test_stop_string_truncates_text(llm: LLM) -> None:
    greedy_out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                              use_tqdm=False)[0]
    text = greedy_out.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "pick a visible stop string"
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0]
    assert out.finish_reason == "stop"
    assert out.text == text[: text.find(stop)]
    assert greedy_out.token_ids[: len(out.token_ids)] == out.token_ids
    assert_pools_full(llm)


def test_text_prompt_is_tokenized(llm: LLM) -> None:
    ids = llm.tokenizer.encode("The quick brown fox")
    a = llm.generate("The quick brown fox", SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    b = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids


def test_sampler_distribution_matches_temperature_and_top_k() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64)
    p = SamplingParams(temperature=0.5, top_k=3, seed=0)
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(5)
    for _ in range(4000):
        counts[sample(logits, [p], [gen])[0].token] += 1
    want = torch.zeros(5, dtype=torch.float64)
    want[:3] = torch.softmax(logits[0, :3] / 0.5, -1)
    assert counts[3:].sum() == 0
    assert torch.allclose(counts.double() / 4000, want, atol=0.03)


def test_sampler_top_p_keeps_smallest_prefix_reaching_mass() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    seen = {sample(probs.log(), [SamplingParams(top_p=0.75)], [gen])[0].token for _ in range(500)}
    assert seen == {0, 1}
