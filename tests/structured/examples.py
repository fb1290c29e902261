"""The constraints the engine and server tests sample under, and the check of a JSON answer."""

from __future__ import annotations

import json

import jsonschema

# A nested schema: objects, an array of enums, required fields, a pattern; bounded strings, so a
# sample ends well within its max_tokens.
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]},
}, "required": ["name", "age", "tags", "address"]}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"
CHOICES = ["yes", "no", "maybe so"]


def valid_json(text: str, schema: dict = SCHEMA) -> bool:
    """``text`` is JSON that ``schema`` validates."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
