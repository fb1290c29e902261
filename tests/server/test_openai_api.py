"""The official openai client against a real server: completions and chat, streamed and not,
n > 1, seeds, stop strings, logprobs; every output equals the offline `LLM` for the same prompt."""

from __future__ import annotations

import math

import httpx
import pytest
from openai import OpenAI

from replayserve import LLM, SamplingParams
from tests.server.conftest import MODEL_NAME, RunningServer

PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Hybrid language models mix"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a Mamba layer?"}]


@pytest.fixture(scope="module")
def client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_greedy_completions_equal_offline(client: OpenAI, offline: LLM, server: RunningServer) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(PROMPTS + [{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)
    response = client.completions.create(model=MODEL_NAME, prompt=PROMPTS, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [o.text for o in expected[:3]]
    assert all(c.finish_reason == "length" for c in response.choices)
    assert response.usage.completion_tokens == 36
    assert response.usage.prompt_tokens == sum(len(o.prompt_token_ids) for o in expected[:3])
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == expected[3].text
    server.assert_pools_full()


def test_streamed_completion_equals_offline(client: OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                                use_tqdm=False)[0]
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert len(chunks) > 2, "a stream sends its tokens as they come, not at once"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == len(expected.prompt_token_ids)


def test_chat_streamed_and_whole_equal_offline_chat(client: OpenAI, offline: LLM) -> None:
    expected = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)[0]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected.text
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids) and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_with_seed_equals_offline_and_repeats(client: OpenAI, offline: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=7, n=3, ignore_eos=True)
    expected = [c.text for c in offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs]
    kwargs = {"model": MODEL_NAME, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
              "seed": 7, "n": 3, "extra_body": {"ignore_eos": True}}
    first = [c.text for c in sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)]
    assert first == expected
    assert len(set(first)) > 1, "completion i samples from seed + i"
    streamed = ["", "", ""]
    for chunk in client.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected


def test_stop_string_cuts_the_text_as_offline(client: OpenAI, offline: LLM) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full = offline.generate(PROMPTS[2], greedy, use_tqdm=False)[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]  # a string the greedy output will reach
    assert len(stop) == 3
    expected = offline.generate(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True,
                                                            stop=[stop, "never seen"]), use_tqdm=False)[0]
    assert expected.finish_reason == "stop"
    kwargs = {"model": MODEL_NAME, "prompt": PROMPTS[2], "max_tokens": 24, "temperature": 0,
              "stop": [stop, "never seen"], "extra_body": {"ignore_eos": True}}
    whole = client.completions.create(**kwargs).choices[0]
    assert (whole.text, whole.finish_reason) == (expected.text, "stop")
    assert stop not in whole.text
    # Streamed, the stop string's first characters must not leak out before it is recognized.
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected.text


def test_logprobs_equal_offline(client: OpenAI, offline: LLM) -> None:
    expected = offline.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                           logprobs=3), use_tqdm=False)[0].outputs[0]
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    sampled = [lp[t].logprob for lp, t in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert got.token_logprobs == pytest.approx(sampled, abs=1e-9)
    for top, alternatives in zip(got.top_logprobs, expected.logprobs, strict=True):
        best = sorted((a.logprob for a in alternatives.values()), reverse=True)[:3]
        # {text: logprob}: tokens whose texts are equal (bytes of a split character) share a key.
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(best[0])
        assert all(any(math.isclose(v, b) for b in best) for v in top.values())

    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob), "greedy samples the most likely token"


def test_completion_logprobs_hold_the_sampled_token_outside_the_top_k(client: OpenAI, offline: LLM) -> None:
    """OpenAI and vLLM put the sampled token among a completion token's top_logprobs even when it
    is not in the top k (k + 1 entries); chat lists it apart (`content[i]`) and keeps k."""
    k, hot = 1, {"temperature": 3.0, "seed": 5, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    params = SamplingParams(temperature=3.0, seed=5, max_tokens=12, ignore_eos=True, logprobs=k)
    expected = offline.generate(PROMPTS[0], params, use_tqdm=False)[0].outputs[0]
    ranks = [lp[t].rank for lp, t in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert any(rank > k for rank in ranks), "a hot temperature samples a token outside the top k"
    got = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], logprobs=k, **hot).choices[0].logprobs
    assert len(got.top_logprobs) == len(expected.token_ids)
    for top, sampled, rank in zip(got.top_logprobs, got.token_logprobs, ranks, strict=True):
        assert len(top) == (k + 1 if rank > k else k)
        assert any(math.isclose(v, sampled) for v in top.values())

    want = offline.chat(MESSAGES, params, use_tqdm=False)[0].outputs[0]
    content = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, logprobs=True, top_logprobs=k,
                                             **hot).choices[0].logprobs.content
    for entry, token, lp in zip(content, want.token_ids, want.logprobs, strict=True):
        assert math.isclose(entry.logprob, lp[token].logprob) and len(entry.top_logprobs) == k
        assert lp[token].rank > k or math.isclose(entry.top_logprobs[0].logprob, entry.logprob)


def test_text_response_format_and_developer_role_are_served(client: OpenAI, offline: LLM) -> None:
    """`response_format={"type": "text"}` is the default spelled out; a developer message renders as
    a system one, as OpenAI treats it."""
    as_system = offline.chat(MESSAGES, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                             use_tqdm=False)[0]
    as_developer = [{**MESSAGES[0], "role": "developer"}, *MESSAGES[1:]]
    chat = client.chat.completions.create(model=MODEL_NAME, messages=as_developer, max_tokens=6, temperature=0,
                                          response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == as_system.text
    assert chat.usage.prompt_tokens == len(as_system.prompt_token_ids)
    completion = client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                           extra_body={"response_format": {"type": "text"}})
    assert completion.choices[0].finish_reason in ("length", "stop")


def test_chat_without_max_tokens_runs_to_the_context_length(client: OpenAI, server: RunningServer) -> None:
    room = server.llm.config.resolved_max_model_len - len(server.llm.chat_template.prompt_ids(
        MESSAGES, server.llm.get_tokenizer()))
    chat = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == room and chat.choices[0].finish_reason == "length"


def test_models_health_and_metrics(client: OpenAI, server: RunningServer) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert httpx.get(f"{server.base_url}/health").status_code == 200

    def counter(text: str, name: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    before = httpx.get(f"{server.base_url}/metrics").text
    client.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    after = httpx.get(f"{server.base_url}/metrics").text
    name = "replayserve_generation_tokens_total"
    assert counter(after, name) - counter(before, name) == 5
    assert counter(after, "replayserve_time_to_first_token_seconds_count") > counter(
        before, "replayserve_time_to_first_token_seconds_count")
    # The core's own TTFT: one more request, a positive time no longer than the front end's.
    core_n = "replayserve_core_time_to_first_token_requests_total"
    core_s = "replayserve_core_time_to_first_token_seconds"
    assert counter(after, core_n) - counter(before, core_n) == 1
    core_ttft = counter(after, core_s) - counter(before, core_s)
    front_ttft = counter(after, "replayserve_time_to_first_token_seconds_sum") - counter(
        before, "replayserve_time_to_first_token_seconds_sum")
    assert 0 < core_ttft <= front_ttft
    for metric in ("replayserve_num_requests_running", "replayserve_num_requests_waiting",
                   "replayserve_prompt_tokens_total", "replayserve_inter_token_latency_seconds_bucket",
                   'replayserve_prefix_cache_hits_tokens_total{group="mamba"', "replayserve_prefix_cache_queries",
                   "replayserve_spec_decode_draft_tokens_total", "replayserve_spec_decode_accepted_tokens_total",
                   'replayserve_cache_usage{model_name="tiny",pool="kv_blocks"}'):
        assert metric in after, metric
