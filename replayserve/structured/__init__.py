"""Structured outputs: a request's output constrained by a JSON schema, a regular expression, a
choice of strings or an EBNF grammar, with xgrammar (the optional `structured` extra).

`params.py` (what a request asks, no dependency), `grammar.py` (parsing and checking, cached),
`schema_check.py` (JSON-schema keywords the grammar engine would not enforce), `compiler.py`
(token masks for a tokenizer, off the step loop), `request_grammar.py` (one request's matcher).
The engine's side is `engine/grammars.py`."""

from replayserve.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
