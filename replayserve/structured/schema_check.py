"""JSON-schema keywords the grammar engine reads but would not enforce.

xgrammar 0.2.9 turns a JSON schema into a grammar; for the keywords below it builds the grammar as
if they were absent (found by compiling each with and without it and comparing the grammars, and
from vLLM's list of xgrammar's gaps), so an output could break the schema. A schema that uses one
is refused, naming it and where it is, rather than served with a guarantee it does not have.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# xgrammar's string formats (json_schema_converter.cc); another format would be ignored.
STRING_FORMATS = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid", "uri",
    "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})
# Keywords never enforced, with why, as the refusal says it.
UNENFORCED = {
    "not": "negation is not supported",
    "if": "conditional schemas (if/then/else) are not supported",
    "then": "conditional schemas (if/then/else) are not supported",
    "else": "conditional schemas (if/then/else) are not supported",
    "uniqueItems": "unique array items are not enforced",
    "contains": "array 'contains' is not enforced",
    "minContains": "array 'contains' is not enforced",
    "maxContains": "array 'contains' is not enforced",
    "dependentRequired": "dependencies between properties are not enforced",
    "dependentSchemas": "dependencies between properties are not enforced",
    "dependencies": "dependencies between properties are not enforced",
}
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_ONE_SCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames",
               "additionalItems", "not", "if", "then", "else", "contains")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def unsupported_keyword(schema: Any) -> tuple[str, str, str] | None:
    """The first keyword of ``schema`` the grammar engine would not enforce: (keyword, where, why),
    `where` a JSON pointer such as "#/properties/tags"; None when it has none."""
    for where, node in _subschemas(schema, "#"):
        found = _unsupported_here(node)
        if found is not None:
            return found[0], where, found[1]
    return None


def _unsupported_here(node: dict[str, Any]) -> tuple[str, str] | None:
    for keyword, why in UNENFORCED.items():
        if keyword in node:
            return keyword, why
    types = node.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if "number" in types and "multipleOf" in node:
        return "multipleOf", "multipleOf is enforced for integers only, not numbers"
    if "format" in node and node["format"] not in STRING_FORMATS:
        return "format", f"format {node['format']!r} is not one of {', '.join(sorted(STRING_FORMATS))}"
    if ("pattern" in node or "format" in node) and ("minLength" in node or "maxLength" in node):
        return ("minLength" if "minLength" in node else "maxLength",
                "length bounds are not enforced together with a pattern or format")
    if "propertyNames" in node and any(k in node for k in ("properties", "patternProperties")):
        return "propertyNames", "propertyNames is not enforced together with properties or patternProperties"
    patterns = node.get("patternProperties")
    if isinstance(patterns, dict) and ("properties" in node or len(patterns) > 1):
        return "patternProperties", "patternProperties is enforced alone only: one pattern, no properties"
    return None


def _subschemas(node: Any, where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema object in ``node`` (itself first) with its JSON pointer; property names are
    names, not keywords, so only the values of schema-holding keywords are walked."""
    if not isinstance(node, dict):
        return
    yield where, node
    for keyword in _ONE_SCHEMA:
        yield from _subschemas(node.get(keyword), f"{where}/{keyword}")
    for keyword in _SCHEMA_LISTS:
        value = node.get(keyword)
        if isinstance(value, list):
            for i, item in enumerate(value):
                yield from _subschemas(item, f"{where}/{keyword}/{i}")
    for keyword in _SCHEMA_MAPS:
        value = node.get(keyword)
        if isinstance(value, dict):
            for name, item in value.items():
                yield from _subschemas(item, f"{where}/{keyword}/{name}")
