"""A request's constraint as an xgrammar `Grammar` (tokenizer-independent: parsing and checking
only, no token masks), cached by its key. `check_structured_outputs` is what validation calls, in
the engine and in the server's front end, so a constraint the engine cannot honour is refused
before it is queued; the engine then compiles the same cached grammar for its tokenizer
(`structured/compiler.py`)."""

from __future__ import annotations

import functools
import json
import re
from typing import TYPE_CHECKING

from replayserve.structured.params import StructuredOutputsParams
from replayserve.structured.schema_check import unsupported_keyword

if TYPE_CHECKING:
    import xgrammar

# Distinct constraints whose parsed grammars are kept (a grammar is a few kB of rules).
GRAMMAR_CACHE_SIZE = 512
# JSON may have whitespace between its tokens, at most this many characters at a place (a newline
# and the indent of a line nested three deep). Unbounded, as vLLM allows it, a model can write
# whitespace until max_tokens: the built-in model did in 29 of 50 samples of a nested schema at
# temperature 1 (400 tokens), and in none with this bound (at most 183 tokens, all valid).
MAX_JSON_WHITESPACE = 16
INSTALL_HINT = "install the grammar engine: pip install 'replayserve[structured]' (xgrammar)"
# xgrammar prefixes its C++ errors with a time and a source location: "[12:05:28] /project/cpp/x.cc:94: ".
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot honour: what is wrong, in the user's terms. reason:
    the message without the field (a server names its own request field)."""

    def __init__(self, reason: str, kind: str | None = None) -> None:
        super().__init__(reason if kind is None else f"StructuredOutputsParams.{kind}: {reason}")
        self.reason = reason


def check_structured_outputs(params: StructuredOutputsParams) -> None:
    """Raises StructuredOutputError naming the field (`StructuredOutputsParams.<kind>`) when the
    constraint does not parse, uses what the engine would not enforce, or xgrammar is missing."""
    grammar_of(params)


def grammar_of(params: StructuredOutputsParams) -> xgrammar.Grammar:
    """The parsed grammar of ``params`` (cached by `StructuredOutputsParams.key`)."""
    return _grammar(*params.key)


@functools.lru_cache(maxsize=GRAMMAR_CACHE_SIZE)
def _grammar(kind: str, spec: str, disable_any_whitespace: bool) -> xgrammar.Grammar:
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise StructuredOutputError(f"structured outputs need xgrammar, which is not installed: {INSTALL_HINT}") from e
    if kind == "json":
        found = unsupported_keyword(json.loads(spec))
        if found is not None:
            keyword, where, why = found
            raise StructuredOutputError(f"the JSON schema's keyword {keyword!r} at {where} is not supported: {why} "
                                        "by the grammar engine; remove it or loosen the schema", kind)
    try:
        if kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(spec if kind == "json" else '{"type": "object"}',
                                                any_whitespace=not disable_any_whitespace, strict_mode=True,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(spec)))
        return xgr.Grammar.from_ebnf(spec)
    except RuntimeError as e:
        what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regular expression",
                "choice": "choices", "grammar": "EBNF grammar"}[kind]
        raise StructuredOutputError(f"the grammar engine cannot use this {what}: {_cpp_message(e)}", kind) from e


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose strings are exactly ``choices``. JSON string escapes are EBNF's."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _cpp_message(error: RuntimeError) -> str:
    lines = [_CPP_PREFIX.sub("", line).strip() for line in str(error).strip().splitlines()]
    return " ".join(line for line in lines if line)
