"""`StructuredOutputsParams` is checked when it is made: exactly one constraint, each of its type."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel

from replayserve import SamplingParams
from replayserve.structured import StructuredOutputsParams


def test_exactly_one_constraint_is_given() -> None:
    with pytest.raises(ValueError, match="exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="got none"):
        StructuredOutputsParams(json_object=False)


def test_a_json_schema_is_kept_as_text_in_its_key_order() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    params = StructuredOutputsParams(json=schema)
    assert isinstance(params.json, str) and list(json.loads(params.json)["properties"]) == ["z", "a"]
    assert StructuredOutputsParams(json=json.dumps(schema)).key[0] == "json"
    assert params == StructuredOutputsParams(json=schema)  # compares by value, so it can travel as data


def test_a_pydantic_model_class_gives_its_schema() -> None:
    class Point(BaseModel):
        x: int
        y: int

    params = StructuredOutputsParams(json=Point)
    assert json.loads(params.json) == Point.model_json_schema()


@pytest.mark.parametrize(("fields", "message"), [
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be a JSON schema"),
    ({"json": 3}, "must be a JSON schema: a dict"),
    ({"regex": ""}, "regex must be a non-empty string"),
    ({"choice": []}, "choice must be a non-empty list"),
    ({"choice": ["a", ""]}, "choice must be a non-empty list of non-empty strings"),
    ({"choice": "ab"}, "choice must be a non-empty list"),
    ({"grammar": "  "}, "grammar must be a non-empty EBNF string"),
    ({"json_object": "yes"}, "json_object must be a bool"),
    ({"regex": "a", "disable_any_whitespace": 1}, "disable_any_whitespace must be a bool"),
    ({"regex": "a", "reasoning_markers": ("<think>",)}, "reasoning_markers must be two non-empty strings"),
])
def test_bad_values_are_refused_naming_the_field(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_choices_and_markers_become_tuples_and_sampling_params_take_them() -> None:
    params = StructuredOutputsParams(choice=["yes", "no"], reasoning_markers=["<think>", "</think>"])
    assert params.choice == ("yes", "no") and params.reasoning_markers == ("<think>", "</think>")
    assert json.loads(params.spec) == ["yes", "no"]
    assert SamplingParams(structured_outputs=params).structured_outputs is params
    with pytest.raises(ValueError, match="structured_outputs must be None or a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"json": {"type": "object"}})


def test_min_tokens_is_refused_beside_a_grammar() -> None:
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=3, max_tokens=8, structured_outputs=StructuredOutputsParams(choice=["a"]))
