"""Requests are checked whole before any is queued: a plain stop string is one string, values a
step would fail on are refused at construction or admission, and a failing prompt in a batch
leaves nothing queued."""

from __future__ import annotations

from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams
from tests.conftest import assert_pools_full

PROMPT = {"prompt_token_ids": [5, 17, 42, 7, 99]}
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)


def test_a_plain_stop_string_is_one_stop_string(llm: LLM) -> None:
    assert SamplingParams(stop="lazy").stop == ("lazy",)
    text = llm.generate(PROMPT, GREEDY, use_tqdm=False)[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(set(stop)) > 1, "the test needs a stop string whose characters differ"
    as_str = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop),
                          use_tqdm=False)[0]
    as_list = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop]),
                           use_tqdm=False)[0]
    assert as_str.text == as_list.text == text[: text.find(stop)]
    assert as_str.token_ids == as_list.token_ids


def test_top_k_zero_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=0).top_k == -1


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(logprobs=10**6), "logprobs"),
    (SamplingParams(stop_token_ids=[10**6]), "stop_token_ids"),
])
def test_values_beyond_the_vocabulary_are_refused_at_admission(llm: LLM, params: SamplingParams,
                                                               message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate(PROMPT, params, use_tqdm=False)
    assert_pools_full(llm)


def test_a_failing_prompt_leaves_no_other_prompt_queued(llm: LLM) -> None:
    too_long = {"prompt_token_ids": [3] * (llm.config.resolved_max_model_len + 1)}
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPT, PROMPT, too_long], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    generated = llm.engine.num_generated_tokens
    out = llm.generate([PROMPT], GREEDY, use_tqdm=False)
    assert len(out) == 1 and llm.engine.num_generated_tokens - generated == len(out[0].token_ids)


def test_an_admission_that_fails_half_way_takes_back_the_requests_it_queued(llm: LLM,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    add = llm.engine.add_request
    calls = []

    def add_then_fail(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return add(*args, **kwargs)

    monkeypatch.setattr(llm.engine, "add_request", add_then_fail)
    with pytest.raises(KeyboardInterrupt):
        llm.generate([PROMPT] * 4, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert not llm.engine.has_unfinished()
    assert_pools_full(llm)
