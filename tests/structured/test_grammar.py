"""Checking a constraint before it is queued: what xgrammar cannot parse, and the JSON-schema
keywords it would not enforce, are refused with a message naming the field and the keyword."""

from __future__ import annotations

import re

import pytest

from replayserve.structured import StructuredOutputsParams
from replayserve.structured.grammar import StructuredOutputError, check_structured_outputs
from replayserve.structured.schema_check import unsupported_keyword

NESTED = {"type": "object", "properties": {
    "name": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b"]}},
    "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"]},
}, "required": ["name", "tags", "address"]}


@pytest.mark.parametrize("params", [
    StructuredOutputsParams(json=NESTED), StructuredOutputsParams(json_object=True),
    StructuredOutputsParams(regex=r"[a-z]{1,8}@[a-z]+\.(com|org)"), StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "a" b\nb ::= [0-9]+'),
    # "not" here names a property: it is not the keyword
    StructuredOutputsParams(json={"type": "object", "properties": {"not": {"type": "integer"}}}),
])
def test_constraints_the_engine_honours_pass(params: StructuredOutputsParams) -> None:
    check_structured_outputs(params)


@pytest.mark.parametrize(("params", "message"), [
    (StructuredOutputsParams(json={"type": "strin"}), r"StructuredOutputsParams\.json: .*schema: Unsupported type"),
    (StructuredOutputsParams(json={"$ref": "#/defs/x"}), r"StructuredOutputsParams\.json: .*Cannot find field 'defs'"),
    (StructuredOutputsParams(regex="(ab"), r"StructuredOutputsParams\.regex: .*regular expression: .*parenthesis"),
    (StructuredOutputsParams(grammar="root ::= foo"), r"StructuredOutputsParams\.grammar: .*Rule \"foo\" is not def"),
])
def test_what_does_not_parse_is_refused_naming_the_field(params: StructuredOutputsParams, message: str) -> None:
    with pytest.raises(StructuredOutputError, match=message) as caught:
        check_structured_outputs(params)
    assert "/project/cpp" not in str(caught.value), "xgrammar's source locations are cut from the message"


@pytest.mark.parametrize(("schema", "keyword", "where"), [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"),
    ({"type": "object", "properties": {"n": {"type": "number", "multipleOf": 0.5}}}, "multipleOf", "#/properties/n"),
    ({"anyOf": [{"type": "string"}, {"not": {"type": "integer"}}]}, "not", "#/anyOf/1"),
    ({"type": "string", "format": "credit-card"}, "format", "#"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 3}, "maxLength", "#"),
    ({"if": {"type": "string"}, "then": {"minLength": 2}}, "if", "#"),
    ({"$defs": {"x": {"type": "object", "dependentRequired": {"a": ["b"]}}}}, "dependentRequired", "#/$defs/x"),
    ({"type": "array", "items": {"type": "array", "contains": {"const": 1}}}, "contains", "#/items"),
])
def test_keywords_the_engine_would_not_enforce_are_refused(schema: dict, keyword: str, where: str) -> None:
    assert unsupported_keyword(schema)[:2] == (keyword, where)
    with pytest.raises(StructuredOutputError, match=re.escape(f"keyword {keyword!r} at {where} is not supported")):
        check_structured_outputs(StructuredOutputsParams(json=schema))


def test_integer_multiple_of_and_supported_formats_pass() -> None:
    assert unsupported_keyword({"type": "integer", "multipleOf": 3}) is None
    assert unsupported_keyword({"type": "string", "format": "date-time"}) is None
    check_structured_outputs(StructuredOutputsParams(json={"type": "integer", "multipleOf": 3}))
