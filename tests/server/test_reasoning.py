"""Reasoning output (`--reasoning-parser`): hand-written transcripts split into reasoning_content
and content, whole and streamed in pieces of any size, with and without a block the template
opened, closed or left out, and with a tool call after the reasoning; through a real server the
split matches offline generation, `chat_template_kwargs` reach the template, and a grammar waits
until the block has closed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from replayserve import LLM, SamplingParams
from replayserve.server.chat_output import ChatChoices
from replayserve.server.reasoning import THINK
from replayserve.server.tool_parsers import TOOL_CALL_PARSERS
from replayserve.server.tools import ToolUse
from tests.server.conftest import (
    ENGINE_OPTIONS,
    MODEL_NAME,
    RunningServer,
    start_server,
    stop_server,
    with_chat_template,
)

OPENED = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n"  # DeepSeek-R1, Qwen3-2507
CLOSED = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"  # no thinking
NONE = "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"  # Qwen3: the model opens it
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 2}}\n</tool_call>'

# (prompt, output, reasoning, content, tool calls)
TRANSCRIPTS = [
    (OPENED, "2 and 2 make 4.\nSure.</think>\n\nThe answer is 4.", "2 and 2 make 4.\nSure.", "\n\nThe answer is 4.", 0),
    (OPENED, "<think>Counting: 1, 2, 3, 4</think>4", "Counting: 1, 2, 3, 4", "4", 0),  # a repeated tag is dropped
    (OPENED, "Still counting < 5 and </thin", "Still counting < 5 and </thin", None, 0),  # never closed
    (NONE, "  <think>Easy.</think>The answer is 4.", "Easy.", "The answer is 4.", 0),
    (NONE, "The answer is <think> 4.", None, "The answer is <think> 4.", 0),
    (CLOSED, "The answer is 4.", None, "The answer is 4.", 0),
    (OPENED, f"I need the add tool.</think>\n{CALL}", "I need the add tool.", None, 1),
    (NONE, f"<think>Use add.</think>Calling it.{CALL}", "Use add.", "Calling it.", 1),
]


@pytest.mark.parametrize(("prompt", "text", "reasoning", "content", "calls"), TRANSCRIPTS)
def test_a_transcript_splits_whole_and_streamed_alike(prompt: str, text: str, reasoning: str | None,
                                                      content: str | None, calls: int) -> None:
    choices = ChatChoices(ToolUse("auto"), TOOL_CALL_PARSERS["hermes"], THINK, prompt)
    message = choices.message(0, text)
    assert (message.reasoning_content, message.content, len(message.tool_calls or [])) == (reasoning, content, calls)
    for seed in range(5):
        rng, streamed = random.Random(seed), ChatChoices(ToolUse("auto"), TOOL_CALL_PARSERS["hermes"], THINK, prompt)
        got_reasoning, got_content, got_calls, at = "", "", [], 0
        while at < len(text) or at == 0:
            n = rng.randint(1, 6)
            delta = streamed.delta(0, text[at : at + n], at + n >= len(text))
            at += n
            if delta is not None:
                got_reasoning += delta.reasoning_content or ""
                got_content += delta.content or ""
                got_calls += delta.tool_calls or []
        # a whole message drops content that is only whitespace before a call; a stream has sent it
        assert got_reasoning == (reasoning or "") and got_content.strip() == (content or "").strip()
        assert [(c.function.name, c.function.arguments) for c in got_calls] == [
            (c.function.name, c.function.arguments) for c in message.tool_calls or []]
        assert streamed.finish_reason(0, "stop") == ("tool_calls" if calls else "stop")


# Opens the block unless enable_thinking is false, then writes it closed and empty (Qwen3's switch).
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n{% if enable_thinking | default(true) %}<think>\n{% else %}<think>\n\n</think>\n\n"
            "{% endif %}")
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def reasoning_model_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_chat_template(tiny_model_dir, tmp_path_factory.mktemp("reasoning") / "model", TEMPLATE)


@pytest.fixture(scope="module")
def reasoning_server(reasoning_model_dir: Path) -> Iterator[RunningServer]:
    running = start_server(reasoning_model_dir, reasoning_parser="deepseek_r1", tool_call_parser="hermes")
    yield running
    stop_server(running)


@pytest.fixture(scope="module")
def offline_chat(reasoning_model_dir: Path) -> LLM:
    return LLM(model=str(reasoning_model_dir), **ENGINE_OPTIONS)


def _offline(llm: LLM, kwargs: dict | None = None) -> str:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return llm.chat(MESSAGES, params, use_tqdm=False, chat_template_kwargs=kwargs)[0].outputs[0].text


def _reasoning(message: object) -> str | None:
    """reasoning_content, a field the openai client keeps as an extra (absent when there is none)."""
    return getattr(message, "reasoning_content", None)


def test_the_split_matches_offline_generation(reasoning_server: RunningServer, offline_chat: LLM) -> None:
    client = OpenAI(base_url=f"{reasoning_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    expected = _offline(offline_chat)  # the tiny model never closes the block: all of it is reasoning
    assert "</think>" not in expected
    args = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
            "extra_body": {"ignore_eos": True}}
    whole = client.chat.completions.create(**args).choices[0].message
    assert _reasoning(whole) == expected and whole.content is None
    streamed = list(client.chat.completions.create(**args, stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(_reasoning(d) or "" for d in deltas) == expected
    assert not "".join(d.content or "" for d in deltas)
    off = client.chat.completions.create(**{**args, "extra_body": {"ignore_eos": True, "chat_template_kwargs": {
        "enable_thinking": False}}}).choices[0].message
    assert off.content == _offline(offline_chat, {"enable_thinking": False}) and _reasoning(off) is None
    reasoning_server.assert_pools_full()


def test_a_grammar_waits_for_the_block_to_close(reasoning_server: RunningServer, offline_chat: LLM) -> None:
    pytest.importorskip("xgrammar")
    client = OpenAI(base_url=f"{reasoning_server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    thinking = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                              extra_body={"guided_choice": ["four", "five"], "ignore_eos": True})
    # the block never closes, so the grammar never starts: the same tokens as without it
    assert _reasoning(thinking.choices[0].message) == _offline(offline_chat)
    assert thinking.choices[0].finish_reason == "length"
    closed = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=300, temperature=1.0,
                                            seed=0, response_format={"type": "json_object"},
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    message = closed.choices[0].message
    assert isinstance(json.loads(message.content), dict) and _reasoning(message) is None
    named = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=300, temperature=1.0, seed=0,
        tools=[{"type": "function", "function": {"name": "add", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}}],
        tool_choice={"type": "function", "function": {"name": "add"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    [call] = named.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) == {"a", "b"}
    reasoning_server.assert_pools_full()


def test_the_cli_offers_the_reasoning_parsers_there_are() -> None:
    from replayserve.cli import REASONING_PARSER_NAMES
    from replayserve.server.reasoning import REASONING_PARSERS

    assert tuple(REASONING_PARSERS) == REASONING_PARSER_NAMES
