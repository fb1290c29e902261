"""Penalties, min_p, min_tokens and include_stop_str_in_output change the distribution exactly as
defined: the batched ops against per-token references computed here (float64), and the engine's
greedy tokens against a loop over the model's own log-probabilities."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from replayserve import LLM, SamplingParams
from replayserve.engine.penalties import Penalties, apply_penalties, apply_penalties_ref
from replayserve.engine.sampler import SamplingBatch, filter_logits, filter_ref, sample
from replayserve.sampling_params import FLOAT32_TINY

F64 = torch.float64
VOCAB = 50


def test_batched_penalties_equal_the_reference() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    params = [SamplingParams(repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=-0.4),
              SamplingParams(),  # untouched
              SamplingParams(repetition_penalty=0.8, min_tokens=5, stop_token_ids=[7]),
              SamplingParams(frequency_penalty=2.0, min_tokens=2, ignore_eos=True, stop_token_ids=[3, 4]),
              SamplingParams(presence_penalty=1.5)]
    histories = [([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))],
                  [rng.randrange(8) for _ in range(rng.randint(0, 12))]) for _ in params]
    histories[2] = (histories[2][0], histories[2][1][:3])  # below min_tokens: 7 and EOS banned
    logits = torch.randn(len(params), VOCAB, generator=gen, dtype=F64) * 3
    eos = [1]
    penalties = Penalties.build(params, list(range(len(params))), histories, eos, VOCAB, F64, logits.device)
    assert penalties is not None
    got = apply_penalties(logits, penalties)
    for row, (p, (prompt, output)) in enumerate(zip(params, histories, strict=True)):
        want = apply_penalties_ref(logits[row], p, prompt, output, eos)
        assert torch.equal(torch.isinf(got[row]), torch.isinf(want))
        torch.testing.assert_close(got[row], want, rtol=1e-12, atol=1e-12)
    assert torch.isinf(got[2, 7]) and torch.isinf(got[2, 1]) and not torch.isinf(got[3, 1])
    assert torch.equal(got[1], logits[1])
    assert Penalties.build([SamplingParams()], [0], [([1], [2])], eos, VOCAB, F64, logits.device) is None


def test_the_smallest_repetition_penalty_samples_the_repeated_tokens() -> None:
    """float32 logits: a seen positive logit divided by r = float32's smallest normal overflows to
    inf, and inf - inf gave NaN probabilities, from which the sampler drew token 0 every time (as
    r = 1e-300, which float32 rounds to 0, did before SamplingParams refused it). Clamped, the
    repeated positive tokens (1 and 2) share the mass."""
    logits = torch.tensor([[-1.0, 5.0, 4.0, -4.0, 0.5]])  # 4 / 2**-126 = 2**128 > float32 max
    params = SamplingParams(temperature=1.0, repetition_penalty=FLOAT32_TINY)
    penalties = Penalties.build([params], [0], [([1, 2, 3], [])], [], 5, torch.float32, logits.device)
    assert penalties is not None
    assert torch.isfinite(apply_penalties(logits, penalties)).all()
    drawn = {sample(logits, [params], [torch.Generator().manual_seed(seed)], histories=[([1, 2, 3], [])])[0].token
             for seed in range(32)}
    assert drawn == {1, 2}


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_keeps_the_tokens_above_min_p_times_the_top(min_p: float) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=gen, dtype=F64) * 2
    p = SamplingParams(temperature=0.7, min_p=min_p, top_k=20)
    batch = SamplingBatch.build([p] * 3, [None] * 3, [()] * 3, VOCAB, F64, logits.device)
    got = filter_logits(logits, batch).softmax(-1)
    for row in range(3):
        probs = (logits[row] / 0.7).softmax(-1)
        keep = probs >= min_p * probs.max()
        assert keep.sum() >= 1
        torch.testing.assert_close(got[row], filter_ref(logits[row], p).softmax(-1), rtol=1e-12, atol=1e-12)
        assert torch.equal(got[row] > 0, keep & (filter_ref(logits[row], p) > -torch.inf))


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(model=str(tiny_model_dir), dtype="float64", device="cpu", max_num_seqs=4)


def test_greedy_with_frequency_and_presence_penalties_follows_the_definition(llm: LLM) -> None:
    prompt = [5, 17, 42, 7, 99, 42]
    f, pres = -1.5, -1.0  # negative: repeats are favoured, so the path changes (this model rarely repeats)
    out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                                                    frequency_penalty=f, presence_penalty=pres),
                       use_tqdm=False)[0].outputs[0].token_ids
    vocab = llm.config.model.vocab_size
    want: list[int] = []
    for _ in range(10):  # the model's full distribution after each prefix, penalized by hand
        lp = llm.generate({"prompt_token_ids": prompt + want}, SamplingParams(temperature=0.0, max_tokens=1,
                                                                              logprobs=vocab),
                          use_tqdm=False)[0].outputs[0].logprobs[0]
        scores = {t: v.logprob - f * want.count(t) - (pres if t in want else 0.0) for t, v in lp.items()}
        want.append(max(scores, key=scores.get))
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=10,
                                                                      ignore_eos=True), use_tqdm=False)[0]
    assert out == want and out != plain.outputs[0].token_ids


def test_min_tokens_bans_eos_and_stop_ids_until_reached(tiny_model_dir: Path) -> None:
    llm = LLM(model=str(tiny_model_dir), dtype="float64", device="cpu")
    prompt = {"prompt_token_ids": [5, 17, 42, 7, 99]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    object.__setattr__(llm.engine.config.model, "eos_token_ids", (greedy[1],))
    stopped = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert stopped.token_ids == greedy[:2]
    held = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, min_tokens=5,
                                               stop_token_ids=[greedy[0]]), use_tqdm=False)[0].outputs[0]
    assert len(held.token_ids) >= 5 and greedy[1] not in held.token_ids[:5] and greedy[0] not in held.token_ids[:5]


def test_include_stop_str_in_output(llm: LLM) -> None:
    prompt = {"prompt_token_ids": [5, 17, 42, 7, 99]}
    text = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    kept = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop,
                                               include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert kept.text == text[: text.find(stop) + len(stop)] and kept.stop_reason == stop


@pytest.mark.parametrize(("kwargs", "option"), [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"), ({"include_stop_str_in_output": 1},
                                                           "include_stop_str_in_output"),
])
def test_bad_values_are_refused(kwargs: dict, option: str) -> None:
    with pytest.raises(ValueError, match=f"SamplingParams.{option}"):
        SamplingParams(**kwargs)
