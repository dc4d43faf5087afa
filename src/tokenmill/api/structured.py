"""`response_format` to the grammar the engine enforces (llguidance; `engine/guided.py`).

`text` is no constraint; `json_object` is any JSON object; `json_schema` is an object matching
the given schema, `strict` or not (the grammar makes every output match, so strict costs
nothing). The schema is checked against its JSON Schema metaschema (jsonschema) and then
compiled; a schema llguidance cannot enforce is refused rather than loosely followed. JSON is
generated compact (no free whitespace), so a model cannot spend its tokens on blank space.
jsonschema and llguidance are imported on first use (~150 ms together), not at start-up.
"""
from __future__ import annotations

import re
from typing import Any

from tokenmill.api.errors import invalid_param

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for schema and function names
_JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def response_format_grammar(response_format: dict[str, Any] | None) -> str | None:
    """The grammar for a request's `response_format`; None for plain text. 400 naming the field."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_grammar(ANY_OBJECT, "response_format")
    if kind != "json_schema":
        raise invalid_param("response_format.type",
                            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise invalid_param("response_format.json_schema", "response_format.json_schema must be an object")
    check_name(spec.get("name"), "response_format.json_schema.name")
    if not isinstance(spec.get("strict", False), bool):
        raise invalid_param("response_format.json_schema.strict", "strict must be a boolean")
    schema = spec.get("schema", ANY_OBJECT)
    return json_grammar(check_schema(schema, "response_format.json_schema.schema"),
                        "response_format.json_schema.schema")


def check_name(name: object, param: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid_param(param, f"{param} must be 1-64 letters, digits, underscores or dashes, got {name!r}")
    return name


def check_schema(schema: object, param: str) -> dict[str, Any]:
    """A JSON Schema (an object valid against its metaschema), or a 400 naming `param`."""
    if not isinstance(schema, dict):
        raise invalid_param(param, f"{param} must be a JSON Schema object")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path)
        raise invalid_param(param, f"{param} is not a valid JSON Schema{f' (at {where})' if where else ''}: "
                                   f"{exc.message}") from exc
    return schema


def json_grammar(schema: dict[str, Any], param: str) -> str:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    return checked(grammar, param)


def checked(grammar: str, param: str) -> str:
    """`grammar` if llguidance can enforce it; otherwise a 400 naming `param`."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(grammar)
    except (ValueError, RuntimeError) as exc:
        error = str(exc)
    if error and not error.startswith("WARNING"):
        raise invalid_param(param, f"{param} cannot be enforced: {error}")
    return grammar

