"""Tool calling on /v1/chat/completions: the request's `tools` and `tool_choice` checked, what the template renders
and which parser reads the reply back into `tool_calls`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from lmd.chat_templates import TOOL_FORMATS, ChatTemplate
from lmd.serve.errors import bad_request
from lmd.serve.protocol import ChatCompletionRequest, NamedToolChoice, ToolChoice
from lmd.serve.tool_parsers import TOOL_PARSERS, ToolCallParser
from lmd.turbomind.gen_config import GenerationConfig

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolUse:
    """What a chat request does with tools: `tools` is what the template renders (None: none), `parser` reads the
    reply (None: the reply is plain content)."""

    tools: list[dict[str, Any]] | None = None
    parser: type[ToolCallParser] | None = None
    names: frozenset[str] = frozenset()
    max_calls: int | None = None

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
    check_tool_choice(choice)
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
    return ToolUse([t.model_dump(exclude_none=True) for t in tools], TOOL_PARSERS[name], frozenset(names),
                   None if body.parallel_tool_calls else 1)


def check_tool_choice(choice: ToolChoice | None) -> None:
    """`required` and a named function must constrain the reply to a valid call (structured outputs); until that is
    wired in, they are refused rather than left to a model that may answer in prose."""
    if choice == "required" or isinstance(choice, NamedToolChoice):
        shown = "'required'" if choice == "required" else f"{{'type': 'function', 'function': {{'name': "\
                                                          f"{choice.function.name!r}}}}}"  # type: ignore[union-attr]
        raise bad_request("tool_choice", f"tool_choice={shown} needs the reply constrained to a valid call, which "
                                         "this server does not do yet; send tool_choice 'auto' (the model decides) "
                                         "or 'none'")
