"""Request fields -> the structured output a reply must follow (a GuidedSpec), or None for free text.

OpenAI's `response_format` ({"type": "text"}, {"type": "json_object"}, {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}}) and vLLM's extensions `guided_json` (a schema, as an object or a JSON string),
`guided_regex`, `guided_choice` (a list of strings) and `guided_grammar` (EBNF, root rule `root`). At most one of them
may constrain a request. Every error is a 400 naming the field, compile errors included (`compile_structured_output`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lmd.errors import LmdError
from lmd.serve.errors import bad_request
from lmd.serve.protocol import SamplingRequest
from lmd.turbomind.guided import CompiledGuide, GrammarCompiler, GuidedSpec, InvalidGuide

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


@dataclass(frozen=True)
class StructuredOutput:
    field: str  # the request field that asked for it, e.g. "response_format.json_schema.schema": the 400's param
    spec: GuidedSpec


def structured_output(*, response_format: Any = None, guided_json: Any = None, guided_regex: Any = None,
                      guided_choice: Any = None, guided_grammar: Any = None) -> StructuredOutput | None:
    """The request's constraint, checked for shape (the grammar itself is checked by compiling it)."""
    from_format = None if response_format is None else _response_format(response_format)
    given = [name for name, value in (("response_format", from_format), ("guided_json", guided_json),
                                      ("guided_regex", guided_regex), ("guided_choice", guided_choice),
                                      ("guided_grammar", guided_grammar)) if value is not None]
    if len(given) > 1:
        raise bad_request(given[1], f"{given[0]} and {given[1]} are both given; send only one of them")
    if from_format is not None:
        return from_format
    if guided_json is not None:
        return StructuredOutput("guided_json", GuidedSpec.from_json_schema(_schema("guided_json", guided_json)))
    if guided_regex is not None:
        return StructuredOutput("guided_regex", GuidedSpec("regex", _text("guided_regex", guided_regex)))
    if guided_choice is not None:
        return StructuredOutput("guided_choice", GuidedSpec.from_choices(_choices(guided_choice)))
    if guided_grammar is not None:
        return StructuredOutput("guided_grammar", GuidedSpec("grammar", _text("guided_grammar", guided_grammar)))
    return None


def compile_structured_output(compiler: GrammarCompiler, output: StructuredOutput) -> CompiledGuide:
    """The compiled grammar (cached by the compiler), or a 400 naming the field when it does not compile."""
    try:
        return compiler.compile(output.spec)
    except InvalidGuide as exc:
        raise bad_request(output.field, f"{output.field} is invalid: {exc.reason}") from None
    except LmdError as exc:  # xgrammar is not installed on this server
        raise bad_request(output.field, f"{output.field} cannot be followed here: {exc}") from None


def request_structured_output(body: SamplingRequest) -> StructuredOutput | None:
    """The constraint a /v1/chat/completions or /v1/completions body asks for (protocol.SamplingRequest)."""
    response_format = body.response_format
    return structured_output(
        response_format=None if response_format is None else response_format.model_dump(by_alias=True,
                                                                                         exclude_unset=True),
        guided_json=body.guided_json, guided_regex=body.guided_regex, guided_choice=body.guided_choice,
        guided_grammar=body.guided_grammar)


def _response_format(value: Any) -> StructuredOutput | None:
    if not isinstance(value, dict):
        raise bad_request("response_format", f"response_format must be an object such as {{\"type\": \"json_object\"}}, "
                                             f"got {_shown(value)}")
    kind = value.get("type")
    if kind is None:
        raise bad_request("response_format.type", "response_format.type is missing; send one of "
                                                  + ", ".join(RESPONSE_FORMAT_TYPES))
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request("response_format.type", f"response_format.type={_shown(kind)} is not supported; use one of "
                                                  + ", ".join(RESPONSE_FORMAT_TYPES))
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("response_format", GuidedSpec("json_object"))
    body = value.get("json_schema")
    if not isinstance(body, dict):
        raise bad_request("response_format.json_schema", "response_format.json_schema must be an object "
                                                         "{\"name\": ..., \"schema\": {...}}, got " + _shown(body))
    name, strict = body.get("name"), body.get("strict")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name",
                          f"response_format.json_schema.name must be a string, got {_shown(name)}")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict",
                          f"response_format.json_schema.strict must be true or false, got {_shown(strict)}")
    field = "response_format.json_schema.schema"
    if "schema" not in body:
        raise bad_request(field, f"{field} is missing; send the JSON schema the reply must follow")
    # strict: false still constrains the reply, as vLLM does: a schema given is a schema followed.
    return StructuredOutput(field, GuidedSpec.from_json_schema(_schema(field, body["schema"])))


def _schema(field: str, value: Any) -> dict[str, Any] | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise bad_request(field, f"{field} is not valid JSON: {exc}") from None
    if not isinstance(value, (dict, bool)):
        raise bad_request(field, f"{field} must be a JSON schema (an object), got {_shown(value)}")
    return value


def _text(field: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise bad_request(field, f"{field} must be a non-empty string, got {_shown(value)}")
    return value


def _choices(value: Any) -> list[str]:
    if not isinstance(value, (list, tuple)) or not value:
        raise bad_request("guided_choice", f"guided_choice must be a non-empty list of strings, got {_shown(value)}")
    for i, choice in enumerate(value):
        if not isinstance(choice, str) or not choice:
            raise bad_request(f"guided_choice.{i}", f"guided_choice.{i} must be a non-empty string, got "
                                                    f"{_shown(choice)}")
    return list(value)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
