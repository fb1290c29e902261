"""Structured outputs through a real server with the official openai client, on the built-in
model (which writes Python, never JSON, by itself): `response_format` json_schema and json_object,
vLLM's `guided_*` and `structured_outputs` extra fields, streamed and not, on the baseline backend
without speculation and on ReplaySSM with n-gram speculation; `chat.completions.parse` with a
pydantic model; constraints the engine cannot honour get a 400 naming the field, and the server
goes on serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI
from pydantic import BaseModel

from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server
from tests.structured.examples import CHOICES, EMAIL, SCHEMA, valid_json

pytest.importorskip("xgrammar")

RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
MESSAGES = [{"role": "user", "content": "def describe(person):"}]
SAMPLES = 24  # enough to see the masks hold across samples; 50 took 30-40 s a test on CI's 2 cores
# Two servers, not the four combinations: the engine's own tests (tests/structured/, tests/engine/)
# cross every backend with speculation on and off; here the plainest engine and the one whose
# grammar-cut drafts roll back by cursor, so that CI stays under its time budget.
CONFIGS = {
    "baseline": {"ssm_backend": "baseline", "speculative": None},
    "replay-ngram": {"ssm_backend": "replay", "speculative": {"method": "ngram", "num_speculative_tokens": 2}},
}



@pytest.fixture(scope="module", params=list(CONFIGS))
def code_server(request: pytest.FixtureRequest) -> Iterator[RunningServer]:
    running = start_server("replayserve/tiny-code", engine={"dtype": "float32", "max_num_seqs": SAMPLES,
                                                             **CONFIGS[request.param]})
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def client(code_server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{code_server.base_url}/v1", api_key="unused", max_retries=0, timeout=600)


def _streamed_texts(stream: Iterator, n: int) -> tuple[list[str], list[str | None]]:
    texts, reasons = [""] * n, [None] * n
    for chunk in stream:
        for choice in chunk.choices:
            piece = choice.delta.content if hasattr(choice, "delta") else choice.text
            texts[choice.index] += piece or ""
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    return texts, reasons


def test_a_nested_schema_holds_in_every_chat_sample(client: OpenAI, code_server: RunningServer) -> None:
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=SAMPLES, temperature=1.0,
                                              seed=0, max_tokens=300, response_format=RESPONSE_FORMAT)
    texts = [c.message.content for c in response.choices]
    assert all(valid_json(t) for t in texts), [t for t in texts if not valid_json(t)]
    assert {c.finish_reason for c in response.choices} == {"stop"} and len(set(texts)) > SAMPLES * 4 // 5
    code_server.assert_pools_full()


def test_a_nested_schema_holds_in_every_streamed_completion(client: OpenAI, code_server: RunningServer) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt="def area(r):", n=SAMPLES, temperature=1.0, seed=1,
                                       max_tokens=300, stream=True, extra_body={"guided_json": SCHEMA})
    texts, reasons = _streamed_texts(stream, SAMPLES)
    assert all(valid_json(t) for t in texts), [t for t in texts if not valid_json(t)]
    assert set(reasons) == {"stop"}
    if code_server.llm.config.speculative is not None:
        assert code_server.llm.get_metrics()["spec_num_accepted_tokens"] > 0, "drafts verified under the masks"


def test_regex_and_choice_hold_in_every_sample_streamed_and_not(client: OpenAI) -> None:
    stream = client.completions.create(model=MODEL_NAME, prompt="def f(x):", n=SAMPLES, temperature=1.0, seed=2,
                                       max_tokens=40, stream=True, extra_body={"guided_regex": EMAIL})
    texts, _ = _streamed_texts(stream, SAMPLES)
    assert all(re.fullmatch(EMAIL, t) for t in texts), texts
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=SAMPLES, temperature=1.0,
                                              seed=3, max_tokens=40,
                                              extra_body={"structured_outputs": {"choice": CHOICES}})
    assert all(c.message.content in CHOICES for c in response.choices)
    assert len({c.message.content for c in response.choices}) > 1


def test_without_a_constraint_the_model_writes_no_json(client: OpenAI, code_server: RunningServer) -> None:
    if code_server.llm.config.ssm_backend != "baseline":  # the "baseline" server of CONFIGS
        pytest.skip("once is enough")
    response = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, n=SAMPLES, temperature=1.0,
                                              seed=0, max_tokens=60)
    assert sum(valid_json(c.message.content) for c in response.choices) == 0


class Address(BaseModel):
    city: str
    zip: str


class Person(BaseModel):
    name: str
    age: int
    address: Address


def test_parse_with_a_pydantic_model_and_json_object(client: OpenAI, code_server: RunningServer) -> None:
    if code_server.llm.config.ssm_backend != "baseline":  # the "baseline" server of CONFIGS
        pytest.skip("once is enough")
    completion = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, temperature=0.7, seed=4,
                                               max_tokens=300, response_format=Person)
    person = completion.choices[0].message.parsed
    assert isinstance(person, Person) and isinstance(person.address, Address)
    anything = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, temperature=1.0, seed=5,
                                              max_tokens=200, response_format={"type": "json_object"})
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "response_format", "Unsupported type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "items": {"type": "string"}, "uniqueItems": True}}}}, "response_format", "'uniqueItems'"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format", "'name'"),
    ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not supported"),
    ({"guided_regex": "(ab"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= foo"}, "guided_grammar", "not defined"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_json": {"type": "number", "multipleOf": 0.1}}, "guided_json", "'multipleOf'"),
    ({"structured_outputs": {"json": SCHEMA, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "not guided_regex and guided_choice"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_a_constraint_the_engine_cannot_honour_gets_a_400(code_server: RunningServer, fields: dict, param: str,
                                                          message: str) -> None:
    if code_server.llm.config.ssm_backend != "baseline":  # the "baseline" server of CONFIGS
        pytest.skip("the front end refuses them; once is enough")
    for endpoint, body in (("chat/completions", {"messages": MESSAGES}), ("completions", {"prompt": "x"})):
        response = httpx.post(f"{code_server.base_url}/v1/{endpoint}", timeout=60,
                              json={"model": MODEL_NAME, **body, **fields, "max_tokens": 5})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and message in error["message"], error
        assert "/project/cpp" not in error["message"]
    ok = httpx.post(f"{code_server.base_url}/v1/completions", timeout=60,
                    json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 3, "guided_choice": ["ok", "fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("ok", "fine")
    code_server.assert_pools_full()
