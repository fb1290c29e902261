"""Tool calling through a real server with the openai client, for both parsers: the model's calls
(written here under a regex, as the tiny model would never write them) come back parsed in
`message.tool_calls` and streamed as `delta.tool_calls` with finish_reason "tool_calls";
`required` and named calls are enforced by the grammar and match their tools' schemas; `none`
parses nothing; the tools, the calls and the tool results reach the chat template; what is wrong
gets a 400 naming the field, and the server goes on serving."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from openai import OpenAI

from replayserve.chat import ChatTemplate
from tests.server.conftest import MODEL_NAME, RunningServer, start_server, stop_server, with_chat_template

pytest.importorskip("xgrammar")

# Qwen2.5's layout, shortened: the tools in a system turn, calls in <tool_call> blocks, results as
# <tool_response> in a user turn, and Qwen3's enable_thinking switch.
TEMPLATE = """{% if tools %}<|im_start|>system
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% endif %}{% for message in messages %}{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% endif %}{% endif %}"""
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
        "required": ["zone"]}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# What each model writes when it calls get_weather (its own format), as a regex the grammar forces.
CALL_REGEX = {
    "hermes": r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", '
              r'"unit": "celsius"\}\}\n</tool_call>',
    "nemotron_json": r'Checking\.<TOOLCALL>\[\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,8}", '
                     r'"unit": "celsius"\}\}\]</TOOLCALL>',
}


@pytest.fixture(scope="module")
def tool_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("tools") / "model", TEMPLATE)


@pytest.fixture(scope="module", params=["hermes", "nemotron_json"])
def tool_server(request: pytest.FixtureRequest, tool_model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(tool_model_dir, tool_call_parser=request.param)
    running.parser = request.param  # type: ignore[attr-defined]
    yield running
    stop_server(running)


def _client(server: RunningServer) -> OpenAI:
    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(stream: Iterator) -> tuple[str, list[dict], str | None]:
    """A streamed choice 0 put together as a client does: content, calls by index, finish reason."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = entry["id"] or call.id
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_the_models_own_call_is_parsed_whole_and_streamed(tool_server: RunningServer) -> None:
    client = _client(tool_server)
    regex = CALL_REGEX[tool_server.parser]  # type: ignore[attr-defined]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0,
                                           max_tokens=200, extra_body={"guided_regex": regex})
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ("Checking.\n" if tool_server.parser == "hermes" else "Checking.")  # type: ignore[attr-defined]
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    assert re.fullmatch("[a-z]{2,8}", arguments["city"]) and arguments["unit"] == "celsius"
    content, calls, finish = _streamed(client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, tools=TOOLS, temperature=0, max_tokens=200, stream=True,
        extra_body={"guided_regex": regex}))
    assert content == choice.message.content and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("get_weather", arguments)]
    tool_server.assert_pools_full()


def test_tool_choice_none_parses_nothing(tool_server: RunningServer) -> None:
    regex = CALL_REGEX[tool_server.parser]  # type: ignore[attr-defined]
    whole = _client(tool_server).chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=TOOLS,
                                                         tool_choice="none", temperature=0, max_tokens=200,
                                                         extra_body={"guided_regex": regex})
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "stop"
    assert re.fullmatch(regex, whole.choices[0].message.content)


@pytest.mark.parametrize("stream", [False, True])
def test_required_calls_name_a_tool_and_match_its_schema(tool_server: RunningServer, stream: bool) -> None:
    client = _client(tool_server)
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required",
              "temperature": 1.0, "seed": 3, "max_tokens": 400}
    if stream:
        samples = [_streamed(client.chat.completions.create(**{**kwargs, "seed": s}, stream=True)) for s in range(4)]
        calls = [[(c["name"], c["arguments"]) for c in got] for _, got, _ in samples]
        finishes = [finish for _, _, finish in samples]
    else:
        response = client.chat.completions.create(**kwargs, n=8)
        calls = [[(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
                 for choice in response.choices]
        finishes = [choice.finish_reason for choice in response.choices]
    assert all(calls) and set(finishes) == {"tool_calls"}
    for name, arguments in (call for sample in calls for call in sample):
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    one = client.chat.completions.create(**kwargs, n=4, parallel_tool_calls=False)
    assert all(len(choice.message.tool_calls) == 1 for choice in one.choices)


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_call_is_that_function_with_valid_arguments(tool_server: RunningServer, stream: bool) -> None:
    client = _client(tool_server)
    kwargs = {"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "temperature": 1.0, "seed": 5,
              "max_tokens": 300, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
    if stream:
        content, calls, finish = _streamed(client.chat.completions.create(**kwargs, stream=True))
        assert content == "" and len(calls) == 1
        name, arguments = calls[0]["name"], calls[0]["arguments"]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        [call] = choice.message.tool_calls
        name, arguments, finish = call.function.name, call.function.arguments, choice.finish_reason
        assert choice.message.content is None
    assert name == "get_time" and finish == "tool_calls"
    jsonschema.validate(json.loads(arguments), PARAMETERS["get_time"])


def test_calls_and_results_go_back_through_the_template(tool_server: RunningServer, tool_model_dir: Path) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "paris", "unit": "celsius"}'}}
    conversation = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}]
    rendered = ChatTemplate.from_dir(tool_model_dir).render(conversation, tools=TOOLS)
    assert '"arguments": {"city": "paris", "unit": "celsius"}' in rendered  # the JSON string became an object
    assert '<tool_response>\n{"temperature": 21}\n</tool_response>' in rendered and '"name": "get_time"' in rendered
    expected = len(tool_server.llm.tokenizer.encode(rendered, add_special_tokens=False))
    client = _client(tool_server)
    reply = client.chat.completions.create(model=MODEL_NAME, messages=conversation, tools=TOOLS, max_tokens=4,
                                           temperature=0)
    assert reply.usage.prompt_tokens == expected
    thinking_off = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0,
                                                  extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    plain = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, temperature=0)
    closed = ChatTemplate.from_dir(tool_model_dir).render(MESSAGES, template_kwargs={"enable_thinking": False})
    assert closed.endswith("<think>\n\n</think>\n\n")
    assert thinking_off.usage.prompt_tokens == len(tool_server.llm.tokenizer.encode(closed, add_special_tokens=False))
    assert thinking_off.usage.prompt_tokens > plain.usage.prompt_tokens


BAD = [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "tool_choice",
     "'get_stock', which is not among the tools (get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "must be one of none, auto, required"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters, digits"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0] must be"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}}}}], "tool_choice": "required"},
     "tools", "'uniqueItems'"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format",
     "cannot be used with a tool_choice that forces a call"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs", "must not set ['messages']"),
]


@pytest.mark.parametrize(("fields", "param", "message"), BAD, ids=[str(i) for i in range(len(BAD))])
def test_what_is_wrong_gets_a_400_naming_the_field(tool_server: RunningServer, fields: dict, param: str,
                                                   message: str) -> None:
    response = httpx.post(f"{tool_server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, **fields})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert tool_server.engine.num_in_flight == 0


def test_auto_needs_a_parser_and_the_server_goes_on(server: RunningServer) -> None:
    """The session's server was started without --tool-call-parser."""
    response = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                          json={"model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 3})
    assert response.status_code == 400 and "--tool-call-parser" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tool_choice"
    named = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 300,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}})
    assert named.status_code == 200, named.text
    assert named.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    server.assert_pools_full()
