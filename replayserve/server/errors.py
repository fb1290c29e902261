"""Errors a route answers with, as OpenAI shapes them, and the one place that maps engine and
validation messages to the request field they are about."""

from __future__ import annotations

import re

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from replayserve.server.protocol import error_body

# A refused value names its option: "SamplingParams.top_p must be ..." (sampling_params.py).
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")


_TYPE_NAMES = {"str", "int", "float", "bool"}


class ApiError(Exception):
    """An answer other than 200: status, message, the field at fault (None: the request as a
    whole), OpenAI's error type and code, and extra headers (Retry-After)."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.kind, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def invalid_value(error: ValueError, prompt_field: str, renames: dict[str, str] | None = None) -> ApiError:
    """A 400 for a ValueError of `SamplingParams` or `Engine.validate`: the field is the option the
    message names (renamed where the API calls it otherwise), else the prompt."""
    message = str(error)
    match = _PARAM_IN_MESSAGE.search(message)
    param = prompt_field if match is None else (renames or {}).get(match.group(1), match.group(1))
    if match is not None:
        message = _PARAM_IN_MESSAGE.sub(param, message)
    return ApiError(400, message, param)


def validation_error(exc: RequestValidationError, content_type: str | None) -> ApiError:
    """A 400 for a body FastAPI could not parse or validate, naming the first field at fault.
    ``content_type``: the request's header (FastAPI parses JSON only when it says JSON)."""
    first = exc.errors()[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    kind = first.get("type", "")
    if kind == "json_invalid":
        return ApiError(400, f"the body is not valid JSON: {first.get('msg', '')}", None)
    if not loc:  # the body as a whole: missing, not JSON, or JSON but not an object
        if isinstance(first.get("input"), bytes):  # left unparsed: the content type does not say JSON
            got = "no content type" if not content_type else f"content-type {content_type!r:.80}"
            return ApiError(400, f"the body must be a JSON object sent with content-type: application/json "
                            f"(got {got})", None)
        return ApiError(400, "the body must be a JSON object", None)
    # Unions report one error per member, with the member's type and list indices in the path:
    # the field is the path of names alone.
    field = ".".join(part for part in loc if part.isidentifier() and part not in _TYPE_NAMES)
    if kind == "extra_forbidden":
        return ApiError(400, f"unknown or unsupported field {field!r}", field or None)
    return ApiError(400, f"{field}: {first.get('msg', 'invalid value')} (got {first.get('input')!r:.80})",
                    field or None)
