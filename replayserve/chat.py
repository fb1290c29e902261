"""Chat prompts: the model directory's chat template (`tokenizer_config.json`), rendered with
jinja2 the way Hugging Face renders it, or a documented default."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from replayserve.tokenizer import Tokenizer, check_unicode

# Used when the model directory has no chat template: each message as a role line and its
# content, then the assistant's role line when a reply is to be generated.
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's newer name for system instructions; most chat templates know only "system", so it renders as that.
ROLE_ALIASES = {"developer": "system"}

Message = dict[str, Any]


class ChatTemplate:
    """A compiled chat template and the special tokens it may name (bos_token, eos_token)."""

    def __init__(self, source: str, special_tokens: dict[str, str] | None = None) -> None:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = _tojson  # transformers' (jinja2's escapes <, > and & for HTML)
        try:
            self._template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.source = source
        self.special_tokens = special_tokens or {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ChatTemplate:
        """The template of `tokenizer_config.json` (a string, or a list of named templates, where
        the one named "default" is taken), else `DEFAULT_CHAT_TEMPLATE`."""
        path = Path(model_dir) / "tokenizer_config.json"
        raw: dict[str, Any] = {}
        if path.is_file():
            try:
                raw = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from e
        source = raw.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is not None and not isinstance(source, str):
            raise ValueError(f"{path}: chat_template must be a string or a list of named templates")
        specials = {k: _token_text(raw[k]) for k in ("bos_token", "eos_token") if raw.get(k) is not None}
        return cls(source or DEFAULT_CHAT_TEMPLATE, specials)

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text of one conversation: a list of {"role": ..., "content": str} (an
        assistant's may have `tool_calls` instead of content; a tool's reply has role "tool").
        tools: OpenAI's tool list, the template's `tools` variable (transformers' convention);
        template_kwargs: more variables for the template (`chat_template_kwargs`, e.g. enable_thinking)."""
        check_messages(messages)
        reserved = sorted(set(template_kwargs or {}) & {"messages", "tools", "add_generation_prompt"})
        if reserved:
            raise ValueError(f"chat_template_kwargs must not set {reserved}: the request's own fields set them")
        try:
            return self._template.render(**{**self.special_tokens, **(template_kwargs or {})},
                                         messages=[_template_message(m) for m in messages], tools=tools,
                                         add_generation_prompt=add_generation_prompt)
        except TemplateError as e:
            raise ValueError(f"the chat template failed on these messages: {e}") from e

    def prompt_ids(self, messages: Sequence[Message], tokenizer: Tokenizer, add_generation_prompt: bool = True,
                   tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None
                   ) -> list[int]:
        """The token ids of a rendered conversation (`encode_rendered`)."""
        return encode_rendered(self.render(messages, add_generation_prompt, tools, template_kwargs), tokenizer)


def encode_rendered(prompt: str, tokenizer: Tokenizer) -> list[int]:
    """The token ids of a rendered conversation; the template writes any special tokens itself
    (bos_token), so the tokenizer adds none."""
    return tokenizer.encode(prompt, add_special_tokens=False)


def check_messages(messages: Sequence[Message]) -> None:
    """Raises ValueError naming what is wrong with a conversation."""
    if isinstance(messages, str | dict) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        # An assistant's turn that called tools may have no content (OpenAI sends null).
        content_ok = isinstance(m, dict) and (isinstance(m.get("content"), str) or (
            m.get("role") == "assistant" and calls and m.get("content") is None))
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not content_ok:
            raise ValueError(f"messages[{i}] must be a dict with a string 'role' and a string 'content', got {m!r:.80}")
        if m["role"] not in ROLES:
            raise ValueError(f"messages[{i}]: role {m['role']!r} is not one of {ROLES}")
        if m.get("content") is not None:
            check_unicode(m["content"], f"messages[{i}].content")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not all(
                isinstance(c, dict) and isinstance(c.get("function"), dict)
                and isinstance(c["function"].get("name"), str) for c in calls)):
            raise ValueError(f"messages[{i}].tool_calls must be an assistant's list of {{'type': 'function', "
                             f"'function': {{'name': ..., 'arguments': ...}}}}, got {calls!r:.80}")


def _template_message(message: Message) -> Message:
    """A message as templates expect it: OpenAI's developer role as system, null content as "",
    and tool-call arguments as the object they encode (transformers' convention: templates write
    `arguments | tojson`), where OpenAI sends a JSON string."""
    out = {**message, "role": ROLE_ALIASES.get(message["role"], message["role"])}
    if out.get("content") is None:
        out["content"] = ""
    if out.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"].get(
            "arguments"))}} for c in out["tool_calls"]]
    return out


def _arguments(arguments: Any) -> Any:
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except ValueError:
            return arguments
    return arguments


def _tojson(value: Any, indent: int | None = None, separators: tuple[str, str] | None = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _token_text(token: Any) -> str:
    """tokenizer_config.json writes a special token as a string or as {"content": ...}."""
    return token["content"] if isinstance(token, dict) else str(token)
