"""One chat choice's text as the chat API sends it: reasoning, content and tool calls, whole or as
stream deltas (`ChoiceOutput` for content and calls, `ChatChoices` for a response's choices). The
text is fed as it is detokenized; each `add` returns what may be sent now, `finish` the rest. A
whole response is the same pieces joined.

Tool calls by `ToolUse.mode` (`server/tools.py`):
- auto: content streams until the parser's opening tag; a prefix of the tag that may be forming is
  held back; each call goes out, name and arguments in one delta, once its block has closed; at
  the end the calls of a block left open; text after the calls is dropped (as vLLM does). A call
  that does not parse sends the text from its tag on as content instead.
- named: the output is the function's arguments: the first delta opens the call (id, name), then
  every piece of text is a piece of its arguments.
- required: the output is a JSON list of calls; each goes out once its object has been written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from replayserve.server.protocol import ChatMessage, DeltaFunction, DeltaMessage, DeltaToolCall, FunctionCall, ToolCall
from replayserve.server.reasoning import ReasoningSplitter
from replayserve.server.tags import forming
from replayserve.server.tool_parsers import ParsedCall, ToolCallParser, parse_call
from replayserve.server.tools import ToolUse


@dataclass
class ChatPiece:
    """What a choice gained: content text and tool-call deltas."""

    content: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __iadd__(self, other: ChatPiece) -> ChatPiece:
        self.content += other.content
        self.tool_calls += other.tool_calls
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


class ChoiceOutput:
    def __init__(self, use: ToolUse, parser: ToolCallParser | None) -> None:
        self.use = use
        self.parser = parser if use.mode == "auto" else None
        self.text = ""  # the output so far
        self.sent = 0  # text[:sent] has gone out (as content or as calls)
        self.calls_at: int | None = None  # auto: where the calls start in text
        self.calls: list[ParsedCall] = []  # sent
        self._ids: list[str] = []

    @property
    def called(self) -> bool:
        """Some tool call went out (the finish reason is then "tool_calls")."""
        return bool(self.calls)

    def add(self, text: str) -> ChatPiece:
        """What may go out once ``text`` follows the output."""
        self.text += text
        if self.use.mode == "named":
            return self._named_piece()
        if self.use.mode == "required":
            try:
                return self._calls_piece(self._written_list_items())
            except ValueError:  # not a call: the grammar rules it out; the end decides
                return ChatPiece()
        if self.parser is None:
            return self._content_until(len(self.text))
        if self.calls_at is None:
            at = self.text.find(self.parser.start, self.sent)
            if at < 0:
                return self._content_until(len(self.text) - forming(self.text, self.parser.start))
            piece = self._content_until(at)
            self.calls_at = at
        else:
            piece = ChatPiece()
        try:
            piece += self._calls_piece(self.parser.closed_calls(self.text[self.calls_at :]))
        except ValueError:
            pass  # a closed block that is not a call: decided at the end
        return piece

    def finish(self) -> ChatPiece:
        """The rest, once the output has ended."""
        if self.use.mode == "named":
            return self._named_piece()
        if self.use.mode == "required":
            try:
                items = json.loads(self.text)
                calls = [parse_call(item) for item in items] if isinstance(items, list) else []
            except ValueError:  # cut by max_tokens inside the list: what was written whole
                calls = self._written_list_items()
            return self._calls_piece(calls)
        if self.parser is None or self.calls_at is None:
            return self._content_until(len(self.text))
        try:
            piece = self._calls_piece(self.parser.all_calls(self.text[self.calls_at :]))
        except ValueError:
            self.sent = self.calls_at
            return self._content_until(len(self.text))
        self.sent = len(self.text)
        return piece

    def message(self) -> tuple[str | None, list[ToolCall] | None]:
        """The whole choice after `add` and `finish`: (content, tool calls)."""
        content = self._content
        calls = [ToolCall(id=i, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for i, c in zip(self._ids, self.calls, strict=True)]
        if calls:
            return (content if content.strip() else None), calls
        return content, None

    @property
    def _content(self) -> str:
        if self.use.mode in ("named", "required"):
            return ""
        return self.text[: self.calls_at] if self.calls and self.calls_at is not None else self.text

    def _content_until(self, end: int) -> ChatPiece:
        piece = ChatPiece(self.text[self.sent : end]) if end > self.sent else ChatPiece()
        self.sent = max(self.sent, end)
        return piece

    def _calls_piece(self, calls: list[ParsedCall]) -> ChatPiece:
        """Deltas of the calls among ``calls`` (all so far, in order) not sent yet."""
        new = calls[len(self.calls) :]
        piece = ChatPiece()
        for call in new:
            index = len(self.calls)
            self._ids.append(_call_id())
            self.calls.append(call)
            piece.tool_calls.append(DeltaToolCall(index=index, id=self._ids[-1], function=DeltaFunction(
                name=call.name, arguments=call.arguments)))
        return piece

    def _named_piece(self) -> ChatPiece:
        """The named call's deltas: its opening (once), then the arguments written since."""
        assert self.use.name is not None
        piece = ChatPiece()
        if not self.calls:
            self._ids.append(_call_id())
            self.calls.append(ParsedCall(self.use.name, ""))
            piece.tool_calls.append(DeltaToolCall(index=0, id=self._ids[0], function=DeltaFunction(
                name=self.use.name, arguments="")))
        new = self.text[self.sent :]
        self.sent = len(self.text)
        self.calls[0] = ParsedCall(self.use.name, self.text)
        if new:
            piece.tool_calls.append(DeltaToolCall(index=0, function=DeltaFunction(arguments=new)))
        return piece

    def _written_list_items(self) -> list[ParsedCall]:
        """required: the calls whose objects the JSON list written so far holds whole."""
        decoder = json.JSONDecoder()
        at = self.text.find("[")
        calls: list[ParsedCall] = []
        if at < 0:
            return calls
        at += 1
        while True:
            while at < len(self.text) and self.text[at] in " \t\n\r,":
                at += 1
            try:
                item, at = decoder.raw_decode(self.text, at)
            except ValueError:
                return calls
            calls.append(parse_call(item))


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ChatChoices:
    """The outputs of one chat response's choices, by choice index, made as their text arrives:
    with `--reasoning-parser`, each choice's text is split into reasoning and content first
    (`server/reasoning.py`), and the content goes on to the tool calls."""

    def __init__(self, use: ToolUse, parser: ToolCallParser | None, reasoning_markers: tuple[str, str] | None = None,
                 prompt_text: str = "") -> None:
        self.use, self.parser = use, parser
        self.reasoning_markers, self.prompt_text = reasoning_markers, prompt_text
        self._outputs: dict[int, tuple[ChoiceOutput, ReasoningSplitter | None]] = {}

    def delta(self, index: int, text: str, finished: bool) -> DeltaMessage | None:
        """What choice ``index`` sends for ``text`` (None: nothing yet)."""
        reasoning, piece = self._add(index, text, finished)
        if not piece and not reasoning:
            return None
        return DeltaMessage(reasoning_content=reasoning or None, tool_calls=piece.tool_calls or None,
                            content=piece.content if piece.content or not (piece.tool_calls or reasoning) else None)

    def message(self, index: int, text: str) -> ChatMessage:
        """A whole choice's message, from its whole text."""
        reasoning, _ = self._add(index, text, True)
        content, calls = self._outputs[index][0].message()
        if self.reasoning_markers is not None:
            return ChatMessage(content=content or None, reasoning_content=reasoning or None, tool_calls=calls)
        return ChatMessage(content=content, tool_calls=calls)

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        """"tool_calls" for a choice that called tools and stopped, as OpenAI says it."""
        called = index in self._outputs and self._outputs[index][0].called
        return "tool_calls" if reason == "stop" and called else reason

    def _add(self, index: int, text: str, finished: bool) -> tuple[str, ChatPiece]:
        if index not in self._outputs:
            splitter = None if self.reasoning_markers is None else ReasoningSplitter(self.reasoning_markers,
                                                                                      self.prompt_text)
            self._outputs[index] = ChoiceOutput(self.use, self.parser), splitter
        output, splitter = self._outputs[index]
        reasoning, content = ("", text) if splitter is None else splitter.add(text)
        if finished and splitter is not None:
            more_reasoning, more_content = splitter.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        piece = output.add(content)
        if finished:
            piece += output.finish()
        return reasoning, piece
