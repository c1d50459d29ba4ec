"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked, what the template renders,
which parser reads the reply back into `tool_calls`, and for `required` / a named function the grammar that forces
the reply to be calls in the family's own format (so the same parser always finds them)."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from lmd.chat_templates import TOOL_FORMATS, ChatTemplate
from lmd.serve.errors import bad_request
from lmd.serve.protocol import ChatCompletionRequest, NamedToolChoice
from lmd.serve.structured_outputs import StructuredOutput
from lmd.serve.tool_parsers import TOOL_PARSERS, ToolCallParser
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.guided import GuidedSpec, InvalidGuide, json_schema_ebnf

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolUse:
    """What a chat request does with tools: `tools` is what the template renders (None: none), `parser` reads the
    reply (None: the reply is plain content)."""

    tools: list[dict[str, Any]] | None = None
    parser: type[ToolCallParser] | None = None
    names: frozenset[str] = frozenset()
    max_calls: int | None = None
    forced: tuple[int, ...] = ()  # indices into tools: the reply must call these (tool_choice required / named)

    def new_parser(self) -> ToolCallParser:
        assert self.parser is not None
        return self.parser(self.names, self.max_calls)

    def configure(self, config: GenerationConfig, body: ChatCompletionRequest) -> GenerationConfig:
        """A parser whose opener is a special token ([TOOL_CALLS]) must see it in the text."""
        if self.parser is None or not self.parser.needs_special_tokens:
            return config
        if "skip_special_tokens" in body.model_fields_set and body.skip_special_tokens:
            raise bad_request("skip_special_tokens", f"skip_special_tokens=true would hide the {self.parser.openers[0]} "
                                                     "token that marks this model's tool calls; leave it out")
        return dataclasses.replace(config, skip_special_tokens=False)


def tool_use(body: ChatCompletionRequest, template: ChatTemplate, tokenizer: Any, parser_name: str | None) -> ToolUse:
    """`parser_name`: `lmd serve --tool-call-parser`, else the template family's own format."""
    tools = body.tools or []
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise bad_request(f"tools.{i}.function.name", f"tools.{i}.function.name={name!r}: use 1 to 64 letters, "
                                                          "digits, '_' or '-'")
        if name in names[:i]:
            raise bad_request(f"tools.{i}.function.name", f"tools.{i}.function.name={name!r} is offered twice")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice", "tool_choice needs tools; send the functions in tools or leave it out")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise bad_request("tool_choice", f"tool_choice names {choice.function.name!r}, which is not in tools")
    if not tools or choice == "none":
        return ToolUse()
    if not template.renders_tools(tokenizer):
        raise bad_request("tools", f"this model's chat template ({template.name!r}) has no format for tools; deploy "
                                   "with MODEL_NAME qwen, llama3 or mistral, or hf with a tokenizer template that takes "
                                   "tools, or send tool_choice 'none'")
    name = parser_name or template.tool_call_format(tokenizer)
    if name is None:
        raise bad_request("tools", "this model's chat template renders tools but does not say how its replies write "
                                   f"calls; start lmd serve with --tool-call-parser ({', '.join(TOOL_FORMATS)})")
    forced: tuple[int, ...] = ()
    if choice == "required":
        forced = tuple(range(len(tools)))
    elif isinstance(choice, NamedToolChoice):
        forced = (names.index(choice.function.name),)
    # A named function is called once, as OpenAI does; `required` makes one or more calls (one without parallel).
    max_calls = 1 if isinstance(choice, NamedToolChoice) or not body.parallel_tool_calls else None
    return ToolUse([t.model_dump(exclude_none=True) for t in tools], TOOL_PARSERS[name], frozenset(names),
                   max_calls, forced)


def tool_call_output(use: ToolUse) -> StructuredOutput:
    """The grammar of a forced reply: calls of the forced functions in the parser's format, each call's arguments
    following its function's `parameters`; once the calls are complete only a stop token may follow. Builds each
    call's JSON grammar with xgrammar (milliseconds): run it where compiling runs."""
    assert use.parser is not None and use.tools is not None and use.forced
    parser = use.parser
    schemas, calls = [], []
    for i in use.forced:
        function = use.tools[i]["function"]
        parameters = function.get("parameters")
        schema = {"type": "object", "properties": {
            "name": {"const": function["name"]},
            parser.arguments_key: {"type": "object", "properties": {}} if parameters is None else parameters,
        }, "required": ["name", parser.arguments_key]}
        try:
            grammar = json_schema_ebnf(schema)  # checks the parameters one function at a time, to name it
        except InvalidGuide as exc:
            raise bad_request(f"tools.{i}.function.parameters", f"tools.{i}.function.parameters is not a JSON schema "
                                                                f"this server can follow: {exc.reason}") from None
        schemas.append(schema)
        calls.append(_sequence(parser.call_begin, {"type": "grammar", "grammar": grammar}, parser.call_end))
    single = use.max_calls == 1
    if parser.calls_in_array:
        items = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
        array = {"type": "array", "items": items, "minItems": 1} | ({"maxItems": 1} if single else {})
        tag_format = _sequence(parser.call_begin, {"type": "grammar", "grammar": json_schema_ebnf(array)}, "")
    else:
        one = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
        tag_format = one if single else {"type": "sequence", "elements": [one, {"type": "star", "content": {
            "type": "sequence", "elements": [{"type": "const_string", "value": parser.call_separator}, one]}}]}
    return StructuredOutput("tool_choice", GuidedSpec.from_structural_tag(tag_format))


def _sequence(begin: str, content: dict[str, Any], end: str) -> dict[str, Any]:
    elements = [*([{"type": "const_string", "value": begin}] if begin else []), content,
                *([{"type": "const_string", "value": end}] if end else [])]
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}
