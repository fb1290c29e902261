"""Offline inference written the way a vLLM user writes it; only the import line differs from vLLM
(`from vllm import LLM, SamplingParams`). Each example is followed by checks against references
computed here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from replayserve import LLM, SamplingParams


def test_generate_with_sampling_params_n_stop_and_logprobs(tiny_model_dir: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    # --- as in vLLM ---
    llm = LLM(model=str(tiny_model_dir))
    prompts = ["The quick brown fox", "Once upon a time there was"]
    sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, n=2, seed=0, stop=[".", "!"],
                                     logprobs=3, prompt_logprobs=2)
    outputs = llm.generate(prompts, sampling_params)
    for output in outputs:
        prompt = output.prompt
        for token_id, logprobs in zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]):  # noqa: B905
            print(f"prompt token {logprobs[token_id].decoded_token!r}: {logprobs[token_id].logprob:.3f}")
        for completion in output.outputs:
            generated_text = completion.text
            print(f"Prompt: {prompt!r}, Generated text: {generated_text!r} ({completion.finish_reason})")
            for token_id, logprobs in zip(completion.token_ids, completion.logprobs):  # noqa: B905
                best = min(logprobs.values(), key=lambda lp: lp.rank)
                print(token_id, logprobs[token_id].logprob, logprobs[token_id].rank, best.decoded_token)
            print("cumulative", completion.cumulative_logprob)
    # --- checks ---
    printed = capsys.readouterr().out
    tokenizer = llm.get_tokenizer()
    assert [o.prompt for o in outputs] == prompts and all(len(o.outputs) == 2 for o in outputs)
    for output in outputs:
        assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(output.prompt_token_ids)
        for completion in output.outputs:
            assert f"Generated text: {completion.text!r}" in printed
            assert not any(stop in completion.text for stop in (".", "!"))
            if completion.finish_reason == "stop":
                assert completion.stop_reason in (".", "!")
            else:
                assert completion.finish_reason == "length" and len(completion.token_ids) == 24
            total = sum(lp[t].logprob for t, lp in zip(completion.token_ids, completion.logprobs, strict=True))
            assert math.isclose(completion.cumulative_logprob, total, rel_tol=1e-12)
            for t, lp in zip(completion.token_ids, completion.logprobs, strict=True):
                assert lp[t].decoded_token == tokenizer.token_text(t) and lp[t].rank >= 1
    # Each prompt token's entry is the distribution after its prefix, as a one-token generation sees it.
    ids = outputs[0].prompt_token_ids
    for i in range(1, len(ids)):
        ref = llm.generate({"prompt_token_ids": ids[:i]}, SamplingParams(temperature=0.0, max_tokens=1, logprobs=2),
                           use_tqdm=False)[0].outputs[0].logprobs[0]
        got = outputs[0].prompt_logprobs[i]
        shared = set(ref) & set(got)
        assert len(shared) >= 2, (i, ref, got)  # the top two of both
        for t in shared:
            assert abs(ref[t].logprob - got[t].logprob) < 1e-5 and ref[t].rank == got[t].rank, (i, t)


def test_chat_as_in_vllm(tiny_model_dir: Path) -> None:
    # --- as in vLLM ---
    llm = LLM(model=str(tiny_model_dir))
    sampling_params = SamplingParams(temperature=0.5, max_tokens=8, seed=1)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant"},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a story about a fox."},
    ]
    outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
    for output in outputs:
        prompt = output.prompt
        generated_text = output.outputs[0].text
    # --- checks ---
    rendered = llm.chat_template.render(conversation, True)
    assert len(outputs) == 1 and prompt == rendered and generated_text == outputs[0].outputs[0].text
    assert outputs[0].prompt_token_ids == llm.get_tokenizer().encode(rendered, add_special_tokens=False)
    direct = llm.generate({"prompt_token_ids": outputs[0].prompt_token_ids}, sampling_params, use_tqdm=False)[0]
    assert direct.outputs[0].token_ids == outputs[0].outputs[0].token_ids
