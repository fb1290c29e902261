"""Tool calls in a model's own format, chosen by `--tool-call-parser` (the names are vLLM's):

- `hermes` (Hermes, Qwen2.5 / Qwen3): each call is `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (newlines around the JSON), several blocks for several calls;
- `nemotron_json` (Nemotron-H / Nemotron Nano 2, NVIDIA's vLLM plugin of that name): one
  `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>` block holding a JSON list.

The text before the first opening tag is the message's content (None when empty). A call whose
JSON does not parse makes the whole output content, with no tool calls (as vLLM does).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NamedTuple


class ParsedCall(NamedTuple):
    """One tool call: the function's name and its arguments as JSON text (OpenAI's `arguments`)."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ToolCallParser:
    """A tag-delimited tool-call format. start / end: the tags around a block; listed: a block holds
    a JSON list of calls (else one call)."""

    name: str
    start: str
    end: str
    listed: bool

    def closed_calls(self, text: str) -> list[ParsedCall]:
        """The calls of the blocks ``text`` has closed (raises ValueError for one that is not a call)."""
        return [call for block in self._blocks(text, closed_only=True) for call in self._calls(block)]

    def all_calls(self, text: str) -> list[ParsedCall]:
        """Every call in ``text``, a last block left open (the output ended inside it) included."""
        return [call for block in self._blocks(text, closed_only=False) for call in self._calls(block)]

    def split(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """A whole output as (content, calls); a call that does not parse leaves it all content."""
        at = text.find(self.start)
        if at < 0:
            return text, []
        try:
            calls = self.all_calls(text[at:])
        except ValueError:
            return text, []
        return (text[:at] if text[:at].strip() else None), calls

    def _blocks(self, text: str, closed_only: bool) -> list[str]:
        closed = re.escape(self.start) + r"(.*?)" + re.escape(self.end)
        pattern = closed if closed_only else f"{closed}|{re.escape(self.start)}(.*)$"
        return [m.group(1) if m.group(1) is not None else m.group(2)
                for m in re.finditer(pattern, text, re.DOTALL)]

    def _calls(self, block: str) -> list[ParsedCall]:
        value = json.loads(block.strip())
        items = value if self.listed and isinstance(value, list) else [value]
        return [parse_call(item) for item in items]


def parse_call(item: Any) -> ParsedCall:
    """{"name": ..., "arguments": {...} (or "parameters")} as a ParsedCall; ValueError otherwise."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise ValueError(f"a tool call must be an object with a string 'name', got {item!r:.80}")
    arguments = item.get("arguments", item.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ParsedCall(item["name"], arguments)


TOOL_CALL_PARSERS = {
    "hermes": ToolCallParser("hermes", "<tool_call>", "</tool_call>", listed=False),
    "nemotron_json": ToolCallParser("nemotron_json", "<TOOLCALL>", "</TOOLCALL>", listed=True),
}
