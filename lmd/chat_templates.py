"""Chat template registry: MODEL_NAME of `lmd deploy` picks how a conversation becomes one prompt string.

A rendered prompt is complete text: every special marker the format needs (BOS included) is in it, so it must be
tokenized with `add_special_tokens=False`. `ChatTemplate.encode` does exactly that; only `base` (raw text, no format)
lets the tokenizer add its own specials, as a plain completion prompt would.

Tools (OpenAI's `[{"type": "function", "function": {...}}]`) and the messages of a tool conversation (assistant
`tool_calls` with `arguments` as an object, `tool` results with `tool_call_id`) render the way each family's official
tool-capable template does: qwen as Qwen2.5, llama3 as Llama 3.1, mistral as Mistral-7B-Instruct-v0.3; `hf` passes
them to the tokenizer's own template. A conversation without tools keeps the family's plain format.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]  # role, content (str); assistant: tool_calls; tool: tool_call_id
Tools = list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")
TOOL_FORMATS = ("llama3_json", "hermes", "mistral")  # how a family's replies write calls (vLLM's parser names)

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
QWEN_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    stop_words: tuple[str, ...]
    renderer: Callable[[list[Message], bool], str] | None  # None: the tokenizer's own chat_template (`hf`)
    tokenizer_adds_specials: bool = False
    tool_renderer: Callable[[list[Message], bool, Tools | None], str] | None = None  # None: the family has no tools
    tool_format: str | None = None  # one of TOOL_FORMATS (`hf`: read from the tokenizer's template)

    def render(self, messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase | None = None,
               add_generation_prompt: bool = True, tools: Tools | None = None,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """`template_kwargs`: extra variables of the tokenizer's template (`hf` only; e.g. Qwen3's enable_thinking)."""
        check_template_kwargs(self, template_kwargs)
        checked = _check_messages(messages)
        uses_tools = tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in checked)
        if self.renderer is not None:
            if not uses_tools:
                return self.renderer(checked, add_generation_prompt)
            if self.tool_renderer is None:
                raise LmdError(f"chat template {self.name!r} has no format for tools or tool messages; deploy with "
                               "MODEL_NAME qwen, llama3 or mistral, or hf with a tokenizer template that takes tools")
            return self.tool_renderer(checked, add_generation_prompt, tools)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise LmdError("chat template 'hf' needs a tokenizer with a chat_template; "
                           "use another MODEL_NAME (e.g. qwen, llama3, base)")
        if tools is not None and not self.renders_tools(tokenizer):
            raise LmdError("the tokenizer's chat template does not render tools (it never reads `tools`); deploy "
                           "with MODEL_NAME qwen, llama3 or mistral to use that family's tool format")
        return tokenizer.apply_chat_template(checked, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **(template_kwargs or {}))

    def encode(self, messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase,
               add_generation_prompt: bool = True, tools: Tools | None = None,
               template_kwargs: dict[str, Any] | None = None) -> list[int]:
        text = self.render(messages, tokenizer, add_generation_prompt, tools, template_kwargs)
        return list(tokenizer(text, add_special_tokens=self.tokenizer_adds_specials)["input_ids"])

    def renders_tools(self, tokenizer: PreTrainedTokenizerBase | None = None) -> bool:
        if self.renderer is not None:
            return self.tool_renderer is not None
        return re.search(r"\btools\b", _hf_source(tokenizer)) is not None

    def tool_call_format(self, tokenizer: PreTrainedTokenizerBase | None = None) -> str | None:
        """How this template's model writes tool calls (one of TOOL_FORMATS), or None when it cannot be told."""
        if self.renderer is not None:
            return self.tool_format
        source = _hf_source(tokenizer)
        if "<tool_call>" in source:
            return "hermes"
        if "[TOOL_CALLS]" in source:
            return "mistral"
        if '"parameters"' in source and ("<|python_tag|>" in source or "ipython" in source):
            return "llama3_json"
        return None


def check_template_kwargs(template: ChatTemplate, template_kwargs: dict[str, Any] | None) -> None:
    """Extra template variables go to the tokenizer's own (Jinja) template only, and never in place of an argument
    of apply_chat_template itself."""
    if not template_kwargs:
        return
    if template.renderer is not None:
        raise LmdError(f"chat_template_kwargs: chat template {template.name!r} is lmd's own and takes no variables; "
                       "deploy with MODEL_NAME hf to render with the tokenizer's template, or leave them out")
    from transformers import PreTrainedTokenizerBase

    arguments = {"messages", *inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters}
    reserved = sorted(set(template_kwargs) & arguments)
    if reserved:
        raise LmdError(f"chat_template_kwargs: {', '.join(reserved)} set how the template is applied, not a "
                       "variable of it; leave them out")


def _hf_source(tokenizer: PreTrainedTokenizerBase | None) -> str:
    """The text of the tokenizer's template that tools render through (a named `tool_use` one when it has one)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        return template.get("tool_use") or template.get("default") or ""
    return template


def _check_messages(messages: Sequence[Any]) -> list[Message]:
    checked = []
    for i, message in enumerate(messages):
        calls = message.get("tool_calls") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if calls and message.get("role") == "assistant" and content is None:
            content = ""
        ok = isinstance(message, dict) and message.get("role") in ROLES and isinstance(content, str)
        if not ok:
            raise LmdError(f"message {i} must be {{'role': system|user|assistant|tool, 'content': str}}, "
                           f"got {message!r}")
        out: Message = {"role": message["role"], "content": content}
        if calls:
            if message["role"] != "assistant" or not all(_is_call(c) for c in calls):
                raise LmdError(f"message {i}: tool_calls belong to an assistant message, each "
                               "{'id': str, 'type': 'function', 'function': {'name': str, 'arguments': dict}}")
            out["tool_calls"] = [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]
        if message["role"] == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise LmdError(f"message {i}: a tool message needs the tool_call_id (str) of the call it answers")
            out["tool_call_id"] = message["tool_call_id"]
        checked.append(out)
    if not checked:
        raise LmdError("a chat needs at least one message")
    return checked


def _is_call(call: Any) -> bool:
    function = call.get("function") if isinstance(call, dict) else None
    return (isinstance(call.get("id"), str) and isinstance(function, dict)  # type: ignore[union-attr]
            and isinstance(function.get("name"), str) and isinstance(function.get("arguments"), dict))


def _split_system(messages: list[Message], default: str = "") -> tuple[str, list[Message]]:
    if messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return default, messages


def _render_llama2(messages: list[Message], add_generation_prompt: bool) -> str:
    """Meta's Llama-2-chat format: the system prompt sits inside the first [INST] block; each answer closes with </s>."""
    system, turns = _split_system(messages)
    out, pending = [], f"<<SYS>>\n{system}\n<</SYS>>\n\n" if system else ""
    for m in turns:
        if m["role"] == "user":
            out.append(f"<s>[INST] {pending}{m['content'].strip()} [/INST]")
            pending = ""
        else:
            out.append(f" {m['content'].strip()} </s>")
    return "".join(out)


def _render_llama3(messages: list[Message], add_generation_prompt: bool) -> str:
    parts = ["<|begin_of_text|>"] + [_llama3_turn(m["role"], m["content"].strip()) for m in messages]
    if add_generation_prompt:
        parts.append(_LLAMA3_REPLY)
    return "".join(parts)


_LLAMA3_REPLY = "<|start_header_id|>assistant<|end_header_id|>\n\n"  # a turn's header: the assistant replies next


def _llama3_turn(role: str, text: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n{text}<|eot_id|>"


def _render_vicuna(messages: list[Message], add_generation_prompt: bool) -> str:
    """FastChat's vicuna_v1.1: turns separated by a space after the user, by </s> after the assistant."""
    system, turns = _split_system(messages, VICUNA_SYSTEM)
    parts = [f"{system} "]
    for m in turns:
        parts.append(f"USER: {m['content']} " if m["role"] == "user" else f"ASSISTANT: {m['content']}</s>")
    if add_generation_prompt:
        parts.append("ASSISTANT:")
    return "".join(parts)


def _render_internlm(messages: list[Message], add_generation_prompt: bool) -> str:
    system, turns = _split_system(messages)
    parts = ["<s>"] + ([f"<|System|>:{system}\n"] if system else [])
    for m in turns:
        parts.append(f"<|User|>:{m['content']}<eoh>\n" if m["role"] == "user" else f"<|Bot|>:{m['content']}<eoa>\n")
    if add_generation_prompt:
        parts.append("<|Bot|>:")
    return "".join(parts)


def _render_mistral(messages: list[Message], add_generation_prompt: bool) -> str:
    """Mistral-Instruct: a system prompt is prepended to the first user message (the format has no system role)."""
    system, turns = _split_system(messages)
    parts = ["<s>"]
    for m in turns:
        if m["role"] == "user":
            content = f"{system}\n\n{m['content']}" if system else m["content"]
            parts.append(f"[INST] {content} [/INST]")
            system = ""
        else:
            parts.append(f"{m['content']}</s>")
    return "".join(parts)


def _render_chatml(messages: list[Message], add_generation_prompt: bool, tools: Tools | None = None) -> str:
    """ChatML; tools and tool messages as Qwen2.5-Instruct's template writes them: tool signatures in the system
    turn, calls in <tool_call> tags, results as <tool_response> blocks in one user turn per run of tool messages.
    Without them it is plain ChatML."""
    system, turns = _split_system(messages, QWEN_SYSTEM)
    if tools is None:
        parts = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    else:
        signatures = "".join("\n" + _tojson(t) for t in tools)
        parts = [f"<|im_start|>system\n{system}\n\n# Tools\n\nYou may call one or more functions to assist with the "
                 "user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                 f"<tools>{signatures}\n</tools>\n\nFor each function call, return a json object with function name "
                 "and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                 '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n']
    for i, m in enumerate(turns):
        if "tool_calls" in m:
            calls = "".join(f'\n<tool_call>\n{{"name": "{c["function"]["name"]}", "arguments": '
                            f'{_tojson(c["function"]["arguments"])}}}\n</tool_call>' for c in m["tool_calls"])
            content = f"\n{m['content']}" if m["content"] else ""
            parts.append(f"<|im_start|>assistant{content}{calls}<|im_end|>\n")
        elif m["role"] == "tool":
            opens = i == 0 or turns[i - 1]["role"] != "tool"
            closes = i == len(turns) - 1 or turns[i + 1]["role"] != "tool"
            parts.append(("<|im_start|>user" if opens else "") + f"\n<tool_response>\n{m['content']}\n</tool_response>"
                         + ("<|im_end|>\n" if closes else ""))
        else:
            parts.append(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def _render_llama31_tools(messages: list[Message], add_generation_prompt: bool, tools: Tools | None) -> str:
    """Llama 3.1-Instruct's template (tools in the first user message, its default): an ipython environment, calls
    as {"name", "parameters"} JSON, one per assistant turn, results in ipython turns (JSON-encoded, as it does)."""
    system, turns = _split_system(messages)
    environment = "Environment: ipython\n" if tools is not None else ""
    parts = ["<|begin_of_text|>", _llama3_turn("system", f"{environment}Cutting Knowledge Date: December 2023\n"
                                                         f"Today Date: 26 Jul 2024\n\n{system.strip()}")]
    if tools is not None:
        if not turns:
            raise LmdError("Llama 3.1 puts the tools in the first user message; send one")
        signatures = "".join(json.dumps(t, indent=4, ensure_ascii=False) + "\n\n" for t in tools)
        parts.append(_llama3_turn("user", "Given the following functions, please respond with a JSON for a function "
                                          "call with its proper arguments that best answers the given prompt.\n\n"
                                          'Respond in the format {"name": function name, "parameters": dictionary of '
                                          "argument name and its value}.Do not use variables.\n\n"
                                          f"{signatures}{turns[0]['content'].strip()}"))
        turns = turns[1:]
    for m in turns:
        if "tool_calls" in m:
            if len(m["tool_calls"]) != 1:
                raise LmdError("Llama 3.1 takes one tool call per assistant message; split them")
            call = m["tool_calls"][0]["function"]
            parts.append(_llama3_turn("assistant", f'{{"name": "{call["name"]}", '
                                                   f'"parameters": {_tojson(call["arguments"])}}}'))
        elif m["role"] == "tool":
            parts.append(_llama3_turn("ipython", _tojson(m["content"])))
        else:
            parts.append(_llama3_turn(m["role"], m["content"].strip()))
    if add_generation_prompt:
        parts.append(_LLAMA3_REPLY)
    return "".join(parts)


def _render_mistral_v3_tools(messages: list[Message], add_generation_prompt: bool, tools: Tools | None) -> str:
    """Mistral-7B-Instruct-v0.3's template: [AVAILABLE_TOOLS] before the last user message, the system prompt inside
    the last message when it is the user's, calls and results with 9-character ids."""
    system, turns = _split_system(messages)
    last_user = max((i for i, m in enumerate(turns) if m["role"] == "user"), default=-1)
    parts = ["<s>"]
    for i, m in enumerate(turns):
        if m["role"] == "user":
            if tools is not None and i == last_user:
                parts.append(f"[AVAILABLE_TOOLS] [{', '.join(_mistral_tool(t) for t in tools)}][/AVAILABLE_TOOLS]")
            content = f"{system}\n\n{m['content']}" if system and i == len(turns) - 1 else m["content"]
            parts.append(f"[INST] {content}[/INST]")
        elif "tool_calls" in m:
            calls = [f'{_tojson(c["function"])[:-1]}, "id": "{_mistral_id(c["id"])}"}}' for c in m["tool_calls"]]
            parts.append(f"[TOOL_CALLS] [{', '.join(calls)}]</s>")
        elif m["role"] == "assistant":
            parts.append(f" {m['content'].strip()}</s>")
        elif m["role"] == "tool":
            parts.append(f'[TOOL_RESULTS] {{"content": {m["content"]}, "call_id": "{_mistral_id(m["tool_call_id"])}"}}'
                         "[/TOOL_RESULTS]")
    return "".join(parts)


def _mistral_tool(tool: dict[str, Any]) -> str:
    """Its template writes string values unescaped and the others as JSON; `return` is left out."""
    fields = [f'"{k}": "{v}"' if isinstance(v, str) else f'"{k}": {_tojson(v)}'
              for k, v in tool.get("function", {}).items() if k != "return"]
    return '{"type": "function", "function": {' + ", ".join(fields) + "}}"


def _mistral_id(call_id: str) -> str:
    """Mistral's ids are 9 letters or digits; longer ones (OpenAI's call_...) keep their last 9, as vLLM does."""
    tail = re.sub(r"[^A-Za-z0-9]", "", call_id)[-9:]
    if len(tail) != 9:
        raise LmdError(f"tool call id {call_id!r}: Mistral needs at least 9 letters or digits in a tool call id")
    return tail


def _tojson(value: Any) -> str:
    """Jinja's `tojson` as transformers' templates see it."""
    return json.dumps(value, ensure_ascii=False)


def _render_base(messages: list[Message], add_generation_prompt: bool) -> str:
    return "".join(m["content"] for m in messages)


_TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("llama2", ("</s>",), _render_llama2),
        ChatTemplate("llama3", ("<|eot_id|>", "<|end_of_text|>"), _render_llama3,
                     tool_renderer=_render_llama31_tools, tool_format="llama3_json"),
        ChatTemplate("vicuna", ("</s>",), _render_vicuna),
        ChatTemplate("internlm", ("<eoa>",), _render_internlm),
        ChatTemplate("qwen", ("<|im_end|>", "<|endoftext|>"), _render_chatml,
                     tool_renderer=_render_chatml, tool_format="hermes"),
        ChatTemplate("mistral", ("</s>",), _render_mistral, tool_renderer=_render_mistral_v3_tools,
                     tool_format="mistral"),
        ChatTemplate("base", (), _render_base, tokenizer_adds_specials=True),
        ChatTemplate("hf", (), None),
    )
}
TEMPLATE_NAMES: tuple[str, ...] = tuple(_TEMPLATES)


def get_chat_template(name: str) -> ChatTemplate:
    if name not in _TEMPLATES:
        raise LmdError(f"unknown model name {name!r} (it picks the chat template); "
                       f"use one of {', '.join(TEMPLATE_NAMES)}")
    return _TEMPLATES[name]
