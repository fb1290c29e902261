"""A table of bad requests: each is answered 4xx with an OpenAI-style error naming the field at
fault, admits nothing, and the server goes on serving."""

from __future__ import annotations

import json

import httpx
import pytest

from replayserve.server.protocol import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS
from tests.server.conftest import MODEL_NAME, RunningServer

CHAT = [{"role": "user", "content": "Hi"}]
TOO_LONG = [7] * 1024  # the tiny model's max_model_len is 1024: no room left for an output

# (endpoint, body (a dict, or raw bytes), status, field the error names (None: the body as a whole))
CASES = [
    ("completions", b'{"prompt": "Hi", ', 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", {"model": "gpt-4", "prompt": "Hi"}, 404, "model"),
    ("completions", {"prompt": "Hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "temperature": float("nan")}, 400, "temperature"),
    ("completions", {"prompt": "Hi", "top_p": float("nan")}, 400, "top_p"),
    ("completions", {"prompt": "Hi", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"prompt": "Hi", "top_k": -3}, 400, "top_k"),
    ("completions", {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "n": 0}, 400, "n"),
    ("completions", {"prompt": "Hi", "seed": -1}, 400, "seed"),
    ("completions", {"prompt": "Hi", "stop": 5}, 400, "stop"),
    ("completions", {"prompt": "Hi", "stop": [""]}, 400, "stop"),
    ("completions", {"prompt": "Hi", "logprobs": -1}, 400, "logprobs"),
    ("completions", {"prompt": "Hi", "logprobs": MAX_COMPLETION_LOGPROBS + 1}, 400, "logprobs"),
    ("completions", {"prompt": "Hi", "max_tokens": 100000}, 400, "max_tokens"),
    ("completions", {"prompt": [TOO_LONG[:10], TOO_LONG[:1000]], "max_tokens": 30}, 400, "max_tokens"),
    ("completions", {"prompt": "Hi", "response_format": {"type": "yaml"}}, 400, "response_format"),
    ("completions", {"prompt": "Hi", "response_format": "text"}, 400, "response_format"),
    ("completions", {"prompt": "Hi", "stream": "yes"}, 400, "stream"),
    ("completions", {"prompt": "Hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ("completions", {"prompt": "Hi", "logit_bias": {"5": 1}}, 400, "logit_bias"),
    ("completions", {"prompt": "Hi", "stream_options": {"include_usage": "no"}}, 400, "stream_options.include_usage"),
    ("completions", {"max_tokens": 5}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, -2]}, 400, "prompt"),
    ("completions", {"prompt": [1, 100000]}, 400, "prompt"),
    ("completions", {"prompt": TOO_LONG}, 400, "prompt"),
    # A lone surrogate (JSON's "\ud800" escape) used to reach the tokenizer: a TypeError and a 500.
    ("completions", {"prompt": "Hi \ud800"}, 400, "prompt"),
    ("completions", {"prompt": ["Hi", "\udfff"]}, 400, "prompt"),
    ("completions", {"prompt": "Hi", "repetition_penalty": 1e-300}, 400, "repetition_penalty"),
    ("completions", {"prompt": "Hi", "presence_penalty": 1e-300}, 400, "presence_penalty"),
    ("chat/completions", {"messages": []}, 400, "messages"),
    ("chat/completions", {"messages": "Hi"}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "messages"),
    ("chat/completions", {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, 400,
     "top_logprobs"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 100000}, 400, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    ("chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {}}}, 400,
     "response_format"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 3, "max_completion_tokens": 3}, 400, "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi " * 1100}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi \ud800"}]}, 400, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}, 400,
     "messages"),
]


@pytest.mark.parametrize(("endpoint", "body", "status", "param"), CASES,
                         ids=[f"{i}-{c[0]}-{c[3]}" for i, c in enumerate(CASES)])
def test_bad_request_is_refused_with_the_field_named(server: RunningServer, endpoint: str, body: dict | bytes,
                                                     status: int, param: str | None) -> None:
    content = body if isinstance(body, bytes) else json.dumps({"model": MODEL_NAME, **body}).encode()
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", content=content,
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert server.engine.num_in_flight == 0


def test_the_server_still_serves_after_bad_requests(server: RunningServer) -> None:
    for _, body, _, _ in CASES[:6]:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        httpx.post(f"{server.base_url}/v1/completions", content=content, headers={"content-type": "application/json"})
    ok = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                    json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    server.assert_pools_full()


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_sent_as_json_gets_a_clean_message(server: RunningServer, content_type: str | None) -> None:
    """curl -d without -H content-type sends a form; the answer says what to send and echoes no body."""
    body = b'{"prompt": "secret words", "max_tokens": 2}'
    headers = {} if content_type is None else {"content-type": content_type}
    response = httpx.post(f"{server.base_url}/v1/completions", content=body, headers=headers, timeout=30)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("the body must be a JSON object") and "content-type: application/json" in message
    assert "secret" not in message


def test_a_body_of_the_wrong_json_type_gets_a_message_without_a_bare_colon(server: RunningServer) -> None:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=["Hi"], timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"] == "the body must be a JSON object"


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_max_tokens_beyond_the_context_names_the_limits(server: RunningServer, endpoint: str) -> None:
    """vLLM's answer: the context length, the tokens asked for, the prompt's and the completion's."""
    limit = server.llm.config.resolved_max_model_len
    body = {"prompt": [5, 6, 7]} if endpoint == "completions" else {"messages": CHAT}
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", json={**body, "max_tokens": 100000}, timeout=30)
    assert response.status_code == 400
    error = response.json()["error"]
    prompt_tokens = 3 if endpoint == "completions" else len(
        server.llm.chat_template.prompt_ids(CHAT, server.llm.get_tokenizer()))
    assert error["param"] == "max_tokens"
    assert f"maximum context length is {limit} tokens" in error["message"]
    assert f"you requested {prompt_tokens + 100000} tokens ({prompt_tokens} in the " in error["message"]
    assert f"at most {limit - prompt_tokens}" in error["message"]


def test_max_tokens_that_just_fits_the_context_is_served(server: RunningServer) -> None:
    limit = server.llm.config.resolved_max_model_len
    prompt = TOO_LONG[: limit - 4]
    fits = httpx.post(f"{server.base_url}/v1/completions", timeout=30,
                      json={"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
    assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 4
    over = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 5}, timeout=30)
    assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize(("endpoint", "body", "names"), [
    ("completions", {"prompt": "Hi \ud800"}, "prompt is not valid Unicode: '\\ud800' at index 3"),
    ("completions", {"prompt": ["Hi", "a\udfff"]}, "prompt[1] is not valid Unicode: '\\udfff' at index 1"),
    ("chat/completions", {"messages": [*CHAT, {"role": "user", "content": "\ud800"}]},
     "messages[1].content is not valid Unicode"),
])
def test_a_lone_surrogate_names_the_text_that_holds_it(server: RunningServer, endpoint: str, body: dict,
                                                       names: str) -> None:
    # json.dumps escapes the surrogate as JSON allows ("\\ud800"); httpx's json= would fail to encode it
    response = httpx.post(f"{server.base_url}/v1/{endpoint}", content=json.dumps({"model": MODEL_NAME, **body}),
                          headers={"content-type": "application/json"}, timeout=30)
    assert response.status_code == 400, response.text
    assert names in response.json()["error"]["message"]
