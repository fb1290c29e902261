"""A request's constraint on its output: OpenAI's `response_format` or vLLM's extra fields
(`structured_outputs`, `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`), as
`StructuredOutputsParams`. Each refusal is a 400 naming the request field.

The front end parses the constraint (xgrammar's `Grammar`, no token masks; on a worker thread, and
cached) so that a schema the engine cannot honour fails fast with a 400; the engine core then
compiles it for the tokenizer from the same key, off its step loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from replayserve.sampling_params import SamplingParams
from replayserve.server.errors import ApiError
from replayserve.server.protocol import ResponseFormat
from replayserve.structured import StructuredOutputsParams
from replayserve.structured.grammar import StructuredOutputError, check_structured_outputs
from replayserve.structured.params import KINDS

# vLLM's guided_* fields and the constraint each is.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
# What `structured_outputs` may hold: the constraint kinds and vLLM's whitespace option.
_STRUCTURED_OUTPUTS_KEYS = (*KINDS, "disable_any_whitespace")


async def constrain(body: Any, params: SamplingParams, reasoning_markers: tuple[str, str] | None = None,
                    forced: tuple[StructuredOutputsParams, str] | None = None) -> SamplingParams:
    """``params`` with the constraint ``body`` asks for (unchanged when none), checked against the
    grammar engine. reasoning_markers: the grammar waits out a reasoning block
    (`--reasoning-parser`); forced: the grammar of a tool call that `tool_choice` forces ('required'
    or a named function), and the field its errors name."""
    asked = requested(body)
    if forced is not None:
        if asked is not None:
            raise ApiError(400, f"{asked[1]} cannot be used with a tool_choice that forces a call ('required' or a "
                           "named function): the call's grammar constrains the output", asked[1])
        asked = forced
    if asked is None:
        return params
    constraint, field = asked
    if reasoning_markers is not None:
        constraint = dataclasses.replace(constraint, reasoning_markers=reasoning_markers)
    try:
        await asyncio.to_thread(check_structured_outputs, constraint)  # parsing a schema can take milliseconds
    except StructuredOutputError as e:
        raise ApiError(400, f"{field}: {e.reason}", field) from e
    return dataclasses.replace(params, structured_outputs=constraint)


def requested(body: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint of a completions or chat body and the field it came from; None without one."""
    given: list[tuple[dict[str, Any], str]] = []
    if body.response_format is not None and body.response_format.type != "text":
        given.append((_response_format(body.response_format), "response_format"))
    if body.structured_outputs is not None:
        unknown = sorted(set(body.structured_outputs) - set(_STRUCTURED_OUTPUTS_KEYS))
        if unknown:
            raise ApiError(400, f"structured_outputs: unknown or unsupported key(s) {unknown}; the keys are "
                           f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)}", "structured_outputs")
        given.append((dict(body.structured_outputs), "structured_outputs"))
    given += [({kind: getattr(body, field)}, field) for field, kind in GUIDED_FIELDS.items()
              if getattr(body, field) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one constraint on the output, not {' and '.join(f for _, f in given)}", given[1][1])
    fields, field = given[0]
    try:
        return StructuredOutputsParams(**fields), field
    except ValueError as e:
        raise ApiError(400, f"{field}: {str(e).replace('StructuredOutputsParams.', '')}", field) from e


def _response_format(response_format: ResponseFormat) -> dict[str, Any]:
    """OpenAI's response_format as StructuredOutputsParams fields. json_schema.strict is accepted
    either way: the schema is always enforced (as vLLM does)."""
    extra = response_format.model_extra or {}
    if response_format.type == "json_object":
        return {"json_object": True}
    if response_format.type != "json_schema":
        raise ApiError(400, f"response_format type {response_format.type!r} is not supported; the types are 'text' "
                       "(the default), 'json_object' and 'json_schema'", "response_format")
    spec = extra.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ApiError(400, "response_format: json_schema must be an object with a 'name' (a string) and a "
                       "'schema' (a JSON schema object)", "response_format")
    schema = spec.get("schema", {})
    if not isinstance(schema, dict):
        raise ApiError(400, f"response_format: json_schema.schema must be a JSON schema object, got {schema!r:.80}",
                       "response_format")
    return {"json": schema}
