"""What a chat request's `tools` and `tool_choice` ask of its output (OpenAI's semantics, vLLM's
mechanics):

- `none` (the default without tools): no calls are parsed (the tools still reach the template);
- `auto` (the default with tools): the model may call; its output is parsed in its own format by
  the server's `--tool-call-parser` (`server/tool_parsers.py`), which `auto` needs;
- `required`: the output is constrained to a JSON list of calls `[{"name": ..., "parameters":
  {...}}, ...]` (one or more; exactly one with `parallel_tool_calls: false`), each naming a tool
  and matching its parameters' schema;
- a named function (`{"type": "function", "function": {"name": ...}}`): the output is constrained
  to that function's arguments, a JSON object matching its parameters' schema.

`required` and named calls need no parser: the grammar writes them as JSON, as vLLM does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from replayserve.server.errors import ApiError
from replayserve.server.tool_parsers import ToolCallParser
from replayserve.structured import StructuredOutputsParams

# OpenAI's rule for function names.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class ToolUse:
    """mode: "none", "auto", "required" or "named"; name: the named function; tools: the request's
    tools for the template (None without); constraint: the grammar of a required or named call."""

    mode: str
    name: str | None = None
    tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None


def tool_use(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
             parser: ToolCallParser | None) -> ToolUse:
    """Checks a chat request's tools and tool_choice (a 400 naming the field at fault) and says
    what they ask of the output. parser: the server's `--tool-call-parser` (None: not set)."""
    functions = _functions(tools)
    choice = tool_choice if tool_choice is not None else ("auto" if functions else "none")
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise ApiError(400, f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or "
                       "{'type': 'function', 'function': {'name': ...}}, got " f"{choice!r:.80}", "tool_choice")
    if choice == "none":
        return ToolUse("none", tools=tools)
    if not functions:
        raise ApiError(400, f"tool_choice {_shown(choice)} needs tools", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise ApiError(400, "tool_choice 'auto' needs a server started with --tool-call-parser (hermes or "
                           "nemotron_json) to read the model's calls; 'required' and a named function need none",
                           "tool_choice")
        return ToolUse("auto", tools=tools)
    if choice == "required":
        calls = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
             "required": ["name", "parameters"]} for name, schema in functions.items()]}}
        if parallel_tool_calls is False:
            calls["maxItems"] = 1
        return ToolUse("required", tools=tools, constraint=StructuredOutputsParams(json=calls))
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise ApiError(400, "a named tool_choice is {'type': 'function', 'function': {'name': ...}}, got "
                       f"{choice!r:.80}", "tool_choice")
    if name not in functions:
        raise ApiError(400, f"tool_choice names the function {name!r}, which is not among the tools "
                       f"({', '.join(functions)})", "tool_choice")
    return ToolUse("named", name=name, tools=tools, constraint=StructuredOutputsParams(json=functions[name]))


def _functions(tools: list[Any] | None) -> dict[str, dict[str, Any]]:
    """The tools' functions: name -> the JSON schema of its arguments (an empty object's without one)."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., 'parameters': "
                           f"...}}}}, got {tool!r:.80}", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise ApiError(400, f"tools[{i}].function.name must be 1 to 64 letters, digits, '_' or '-', got "
                           f"{name!r:.80}", "tools")
        if name in functions:
            raise ApiError(400, f"tools[{i}]: two tools are named {name!r}", "tools")
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON schema object, got "
                           f"{parameters!r:.80}", "tools")
        functions[name] = parameters or {"type": "object", "properties": {}}
    return functions


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else "naming a function"
