"""Tool calls in the models' own formats, against hand-written transcripts: parsed whole, and
streamed in pieces of any size to the same calls and content, with no piece of an opening tag
leaking into the content; the JSON calls of `required` and a named function likewise."""

from __future__ import annotations

import json
import random

import pytest

from replayserve.server.chat_output import ChatPiece, ChoiceOutput
from replayserve.server.tool_parsers import TOOL_CALL_PARSERS, ParsedCall
from replayserve.server.tools import ToolUse

HERMES = TOOL_CALL_PARSERS["hermes"]
NEMOTRON = TOOL_CALL_PARSERS["nemotron_json"]
WEATHER = ParsedCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = ParsedCall("get_time", '{"zone": "CET"}')

# (parser, transcript, content, calls): Qwen2.5 / Hermes and Nemotron Nano 2 as they write them.
TRANSCRIPTS = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
             '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>',
     "Let me check.\n", [WEATHER, TIME]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', None, [TIME]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}', None, [TIME]),  # cut before the end
    (HERMES, "No tools needed: 2 < 3 and <tool is not a tag.", "No tools needed: 2 < 3 and <tool is not a tag.", []),
    (HERMES, 'Oops <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>',
     'Oops <tool_call>{"name": "get_time", "arguments": {"zone": </tool_call>', []),  # bad JSON: all content
    (NEMOTRON, 'Checking both.<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "get_time", "arguments": {"zone": "CET"}}]</TOOLCALL>', "Checking both.", [WEATHER, TIME]),
    (NEMOTRON, '<TOOLCALL>[{"name": "get_time", "arguments": {"zone": "CET"}}]</TOOLCALL>', None, [TIME]),
    (NEMOTRON, "Plain answer <TOOL", "Plain answer <TOOL", []),
]


def _stream(output: ChoiceOutput, text: str, rng: random.Random) -> ChatPiece:
    joined = ChatPiece()
    at = 0
    while at < len(text):
        n = rng.randint(1, 7)
        joined += output.add(text[at : at + n])
        at += n
    joined += output.finish()
    return joined


@pytest.mark.parametrize(("parser", "text", "content", "calls"), TRANSCRIPTS)
def test_a_transcript_parses_whole_and_streamed_alike(parser, text: str, content: str | None,  # noqa: ANN001
                                                      calls: list[ParsedCall]) -> None:
    assert parser.split(text) == ((content if calls else text), calls)
    for seed in range(5):
        output = ChoiceOutput(ToolUse("auto"), parser)
        joined = _stream(output, text, random.Random(seed))
        got = [ParsedCall(c.function.name, c.function.arguments) for c in joined.tool_calls]
        assert got == calls and [c.index for c in joined.tool_calls] == list(range(len(calls)))
        assert all(c.id and c.id.startswith("call_") for c in joined.tool_calls)
        # content streamed is the text before the first tag: not a character of a tag leaked
        assert joined.content == (content or "" if calls else text)
        message_content, message_calls = output.message()
        assert message_content == (content if calls else text)
        assert [(c.function.name, c.function.arguments) for c in message_calls or []] == calls
        assert output.called == bool(calls)


def test_with_tool_choice_none_tags_are_content() -> None:
    text = TRANSCRIPTS[0][1]
    output = ChoiceOutput(ToolUse("none"), HERMES)
    assert _stream(output, text, random.Random(0)).content == text and not output.called


def test_a_named_call_streams_its_arguments_as_they_come() -> None:
    output = ChoiceOutput(ToolUse("named", name="get_weather"), None)
    arguments = '{"city": "Paris", "unit": "celsius"}'
    pieces = [output.add(arguments[i : i + 5]) for i in range(0, len(arguments), 5)] + [output.finish()]
    deltas = [d for p in pieces for d in p.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and deltas[0].type == "function"
    assert all(d.index == 0 and d.function.name is None for d in deltas[1:])
    assert "".join(d.function.arguments or "" for d in deltas) == arguments
    assert output.message()[1][0].function.arguments == arguments and output.message()[0] is None


def test_required_calls_go_out_as_each_object_is_written() -> None:
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
                       {"name": "get_time", "parameters": {"zone": "CET"}}])
    output = ChoiceOutput(ToolUse("required"), None)
    first_end = text.index("}}") + 2
    assert output.add(text[: first_end - 1]).tool_calls == []
    first = output.add(text[first_end - 1 : first_end + 3]).tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in first] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"})]
    rest = output.add(text[first_end + 3 :]).tool_calls + output.finish().tool_calls
    assert [(c.index, c.function.name) for c in rest] == [(1, "get_time")]
    assert output.message()[0] is None and len(output.message()[1]) == 2


def test_the_cli_offers_the_parsers_there_are() -> None:
    from replayserve.cli import TOOL_CALL_PARSER_NAMES, build_parser

    assert tuple(TOOL_CALL_PARSERS) == TOOL_CALL_PARSER_NAMES
    args = build_parser().parse_args(["serve", "--tool-call-parser", "nemotron_json"])
    assert args.tool_call_parser == "nemotron_json"
