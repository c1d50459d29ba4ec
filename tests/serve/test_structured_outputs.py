"""Request fields -> GuidedSpec: each accepted shape, and a 400 naming the field for each malformed or conflicting one."""

from __future__ import annotations

import json

import pytest

from lmd.serve.errors import ApiError
from lmd.serve.structured_outputs import StructuredOutput, compile_structured_output, structured_output
from lmd.turbomind.guided import GuidedSpec

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}, "required": ["b"]}


def refused(**fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        structured_output(**fields)
    assert caught.value.status == 400 and "\n" not in caught.value.message
    return caught.value


@pytest.mark.parametrize("fields", [{}, {"response_format": {"type": "text"}}, {"guided_json": None}])
def test_free_text(fields):
    assert structured_output(**fields) is None


def test_response_format_json_object():
    assert structured_output(response_format={"type": "json_object"}) == StructuredOutput(
        "response_format", GuidedSpec("json_object"))


@pytest.mark.parametrize("strict", [None, True, False])  # strict: false still constrains, as vLLM does
def test_response_format_json_schema(strict):
    body = {"name": "reply", "schema": SCHEMA} | ({} if strict is None else {"strict": strict})
    output = structured_output(response_format={"type": "json_schema", "json_schema": body})
    assert output.field == "response_format.json_schema.schema"
    assert output.spec.kind == "json_schema" and json.loads(output.spec.value) == SCHEMA
    assert list(json.loads(output.spec.value)["properties"]) == ["b", "a"]  # the schema's order is the reply's


def test_guided_json_as_object_or_string_is_one_spec():
    as_object = structured_output(guided_json=SCHEMA)
    as_string = structured_output(guided_json=json.dumps(SCHEMA, indent=2))
    assert as_object == as_string and as_object.field == "guided_json"
    via_format = structured_output(response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                           "schema": SCHEMA}})
    assert via_format.spec == as_object.spec  # one compile-cache entry, whichever field sent it


def test_guided_regex_choice_grammar():
    assert structured_output(guided_regex=r"\d+") == StructuredOutput("guided_regex", GuidedSpec("regex", r"\d+"))
    choice = structured_output(guided_choice=["yes", "no"])
    assert choice.field == "guided_choice" and choice.spec == GuidedSpec("choice", '["yes", "no"]')
    grammar = 'root ::= "a" | "b"'
    assert structured_output(guided_grammar=grammar).spec == GuidedSpec("grammar", grammar)


def test_a_text_response_format_combines_with_a_guided_field():
    output = structured_output(response_format={"type": "text"}, guided_regex="a+")
    assert output.field == "guided_regex"


@pytest.mark.parametrize(("fields", "named"), [
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, ("response_format", "guided_json")),
    ({"guided_regex": "a", "guided_choice": ["a"]}, ("guided_regex", "guided_choice")),
    ({"guided_json": SCHEMA, "guided_grammar": 'root ::= "a"'}, ("guided_json", "guided_grammar")),
])
def test_two_constraints_name_both_fields(fields, named):
    error = refused(**fields)
    assert error.param == named[1] and all(name in error.message for name in named)
    assert "only one" in error.message


@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"response_format": {}}, "response_format.type", "missing"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'xml' is not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "must be an object"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "missing"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": 3, "schema": {}}}},
     "response_format.json_schema.name", "must be a string"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}},
     "response_format.json_schema.strict", "true or false"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
     "response_format.json_schema.schema", "must be a JSON schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_json": 5}, "guided_json", "must be a JSON schema"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_regex": 3}, "guided_regex", "non-empty string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": "yes"}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["yes", 2]}, "guided_choice.1", "non-empty string"),
    ({"guided_choice": ["yes", ""]}, "guided_choice.1", "non-empty string"),
    ({"guided_grammar": {"root": "a"}}, "guided_grammar", "non-empty string"),
])
def test_malformed_fields_name_the_field(fields, param, says):
    error = refused(**fields)
    assert error.param == param and param in error.message and says in error.message


@pytest.fixture(scope="module")
def compiler(tokenizer):
    pytest.importorskip("xgrammar")
    from lmd.turbomind.guided import GrammarCompiler

    return GrammarCompiler(tokenizer, len(tokenizer))


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= missing"}, "guided_grammar"),
])
def test_compile_errors_are_400s_naming_the_field(compiler, fields, param):
    with pytest.raises(ApiError) as caught:
        compile_structured_output(compiler, structured_output(**fields))
    assert caught.value.status == 400 and caught.value.param == param
    assert caught.value.message.startswith(f"{param} is invalid: ") and "/project/" not in caught.value.message


def test_compile_returns_the_cached_grammar(compiler):
    output = structured_output(guided_choice=["left", "right"])
    assert compile_structured_output(compiler, output) is compiler.compile(output.spec)
