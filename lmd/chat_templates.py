"""Chat template registry: MODEL_NAME of `lmd deploy` picks how a conversation becomes one prompt string.

A rendered prompt is complete text: every special marker the format needs (BOS included) is in it, so it must be
tokenized with `add_special_tokens=False`. `ChatTemplate.encode` does exactly that; only `base` (raw text, no format)
lets the tokenizer add its own specials, as a plain completion prompt would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, str]
ROLES = ("system", "user", "assistant")

VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
QWEN_SYSTEM = "You are a helpful assistant."


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    stop_words: tuple[str, ...]
    renderer: Callable[[list[Message], bool], str] | None  # None: the tokenizer's own chat_template (`hf`)
    tokenizer_adds_specials: bool = False

    def render(self, messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase | None = None,
               add_generation_prompt: bool = True) -> str:
        checked = _check_messages(messages)
        if self.renderer is not None:
            return self.renderer(checked, add_generation_prompt)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            raise LmdError("chat template 'hf' needs a tokenizer with a chat_template; "
                           "use another MODEL_NAME (e.g. qwen, llama3, base)")
        return tokenizer.apply_chat_template(checked, tokenize=False, add_generation_prompt=add_generation_prompt)

    def encode(self, messages: Sequence[Message], tokenizer: PreTrainedTokenizerBase,
               add_generation_prompt: bool = True) -> list[int]:
        text = self.render(messages, tokenizer, add_generation_prompt)
        return list(tokenizer(text, add_special_tokens=self.tokenizer_adds_specials)["input_ids"])


def _check_messages(messages: Sequence[Any]) -> list[Message]:
    checked = []
    for i, message in enumerate(messages):
        ok = isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)
        if not ok:
            raise LmdError(f"message {i} must be {{'role': system|user|assistant, 'content': str}}, got {message!r}")
        checked.append({"role": message["role"], "content": message["content"]})
    if not checked:
        raise LmdError("a chat needs at least one message")
    return checked


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
    parts = ["<|begin_of_text|>"]
    for m in messages:
        parts.append(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>")
    if add_generation_prompt:
        parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)


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


def _render_chatml(messages: list[Message], add_generation_prompt: bool) -> str:
    system, turns = _split_system(messages, QWEN_SYSTEM)
    parts = [f"<|im_start|>system\n{system}<|im_end|>\n"]
    parts += [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in turns]
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
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


def _render_base(messages: list[Message], add_generation_prompt: bool) -> str:
    return "".join(m["content"] for m in messages)


_TEMPLATES: dict[str, ChatTemplate] = {
    t.name: t
    for t in (
        ChatTemplate("llama2", ("</s>",), _render_llama2),
        ChatTemplate("llama3", ("<|eot_id|>", "<|end_of_text|>"), _render_llama3),
        ChatTemplate("vicuna", ("</s>",), _render_vicuna),
        ChatTemplate("internlm", ("<eoa>",), _render_internlm),
        ChatTemplate("qwen", ("<|im_end|>", "<|endoftext|>"), _render_chatml),
        ChatTemplate("mistral", ("</s>",), _render_mistral),
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
