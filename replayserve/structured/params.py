"""`StructuredOutputsParams`: the grammar a request's output must follow (vLLM's
`vllm.sampling_params.StructuredOutputsParams`), checked when it is made. Nothing here imports
the grammar engine: `structured/grammar.py` turns it into a grammar."""

from __future__ import annotations

import json as jsonlib
from dataclasses import dataclass
from typing import Any

# The constraint kinds, exactly one of which a StructuredOutputsParams sets.
KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of:

    json: a JSON schema (a dict, its JSON text, or a pydantic model class); the output is a JSON
    value it validates. Properties not in the schema are not generated (xgrammar's strict mode).
    regex: the output matches the regular expression (whole output).
    choice: the output is one of these strings.
    grammar: an EBNF grammar (GBNF, llama.cpp's dialect, with a `root` rule).
    json_object: True: the output is a JSON object.

    disable_any_whitespace: JSON without free whitespace between tokens (one line, ", " and ": ").
    reasoning_markers: (start, end) of a reasoning block, e.g. ("<think>", "</think>"): the grammar
    applies only after the output has closed it, from the token after the one that completes `end`
    (before it the output is free), or from the first token when the prompt's text after its last
    `start` already holds `end` (a template that closed the block, as Qwen3's enable_thinking=False
    does). The server sets it from `--reasoning-parser`.

    `json` is kept as JSON text (a dict is dumped with its key order, which is the order the
    properties are generated in), so the params travel as plain data and compare by value.
    """

    json: str | dict | Any | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    reasoning_markers: tuple[str, str] | list[str] | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of {', '.join(KINDS)}; got "
                             f"{', '.join(given) if given else 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        if self.regex is not None and (not isinstance(self.regex, str) or not self.regex):
            raise ValueError(f"StructuredOutputsParams.regex must be a non-empty string, got {self.regex!r:.80}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar.strip()):
            raise ValueError(f"StructuredOutputsParams.grammar must be a non-empty EBNF string, got "
                             f"{self.grammar!r:.80}")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice or not all(
                    isinstance(c, str) and c for c in self.choice):
                raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings, got "
                                 f"{self.choice!r:.80}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object not in (None, True, False):
            raise ValueError(f"StructuredOutputsParams.json_object must be a bool, got {self.json_object!r:.80}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError("StructuredOutputsParams.disable_any_whitespace must be a bool, got "
                             f"{self.disable_any_whitespace!r:.80}")
        if self.reasoning_markers is not None:
            markers = self.reasoning_markers
            if not isinstance(markers, list | tuple) or len(markers) != 2 or not all(
                    isinstance(m, str) and m for m in markers):
                raise ValueError("StructuredOutputsParams.reasoning_markers must be two non-empty strings (start, "
                                 f"end), got {markers!r:.80}")
            object.__setattr__(self, "reasoning_markers", tuple(markers))

    @property
    def kind(self) -> str:
        """The constraint set: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema, the pattern, the grammar, or the choices as JSON."""
        value = getattr(self, self.kind)
        if self.kind == "choice":
            return jsonlib.dumps(value, ensure_ascii=False)
        return "" if self.kind == "json_object" else value

    @property
    def key(self) -> tuple[str, str, bool]:
        """What the compiled grammar depends on: the cache key of compiled grammars."""
        return self.kind, self.spec, self.disable_any_whitespace


def _schema_text(schema: Any) -> str:
    """A JSON schema as JSON text: from a dict, a JSON string (checked), or a pydantic model class."""
    if isinstance(schema, type) and hasattr(schema, "model_json_schema"):
        schema = schema.model_json_schema()
    if isinstance(schema, str):
        try:
            parsed = jsonlib.loads(schema)
        except ValueError as e:
            raise ValueError(f"StructuredOutputsParams.json is not valid JSON: {e}") from e
        if not isinstance(parsed, dict | bool):
            raise ValueError(f"StructuredOutputsParams.json must be a JSON schema (an object), got {schema!r:.80}")
        return schema
    if isinstance(schema, dict):
        try:
            return jsonlib.dumps(schema, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"StructuredOutputsParams.json is not JSON-serializable: {e}") from e
    raise ValueError("StructuredOutputsParams.json must be a JSON schema: a dict, its JSON text or a pydantic model "
                     f"class, got {type(schema).__name__}")
