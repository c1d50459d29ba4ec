"""Chat template registry: exact renders of the fixed formats, and ChatML / `hf` against SmolLM2's own template."""

from __future__ import annotations

import pytest

from lmd.chat_templates import TEMPLATE_NAMES, get_chat_template
from lmd.errors import LmdError

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "2+2?"}]


def test_registry_names_and_unknown_name():
    assert set(TEMPLATE_NAMES) >= {"llama2", "llama3", "vicuna", "internlm", "qwen", "mistral", "base", "hf"}
    with pytest.raises(LmdError, match="unknown model name 'chatgpt'.*llama2, llama3"):
        get_chat_template("chatgpt")


def test_llama2_exact():
    assert get_chat_template("llama2").render(CHAT) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]")
    assert get_chat_template("llama2").render(CHAT[1:2]) == "<s>[INST] Hi [/INST]"


def test_llama3_exact():
    assert get_chat_template("llama3").render(CHAT) == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert get_chat_template("llama3").stop_words == ("<|eot_id|>", "<|end_of_text|>")


def test_mistral_vicuna_internlm_exact():
    assert get_chat_template("mistral").render(CHAT) == (
        "<s>[INST] Be brief.\n\nHi [/INST]Hello!</s>[INST] 2+2? [/INST]")
    assert get_chat_template("vicuna").render(CHAT[1:]) == (
        "A chat between a curious user and an artificial intelligence assistant. The assistant gives helpful, "
        "detailed, and polite answers to the user's questions. USER: Hi ASSISTANT: Hello!</s>USER: 2+2? ASSISTANT:")
    assert get_chat_template("internlm").render(CHAT) == (
        "<s><|System|>:Be brief.\n<|User|>:Hi<eoh>\n<|Bot|>:Hello!<eoa>\n<|User|>:2+2?<eoh>\n<|Bot|>:")


def test_base_concatenates_content():
    assert get_chat_template("base").render([{"role": "user", "content": "Once upon"},
                                             {"role": "user", "content": " a time"}]) == "Once upon a time"
    assert get_chat_template("base").stop_words == ()


def test_qwen_default_system_and_generation_prompt():
    text = get_chat_template("qwen").render(CHAT[1:2], add_generation_prompt=False)
    assert text == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_qwen_and_hf_match_smollm2_template(tokenizer, add_generation_prompt):
    reference = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert get_chat_template("hf").render(CHAT, tokenizer, add_generation_prompt) == reference
    assert get_chat_template("qwen").render(CHAT, add_generation_prompt=add_generation_prompt) == reference


def test_encode_adds_no_extra_specials(tokenizer):
    ids = get_chat_template("qwen").encode(CHAT, tokenizer)
    reference = tokenizer(tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False)["input_ids"]
    assert ids == list(reference)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_hf_without_tokenizer_is_an_error():
    with pytest.raises(LmdError, match="needs a tokenizer with a chat_template"):
        get_chat_template("hf").render(CHAT)


def test_bad_messages_are_rejected():
    with pytest.raises(LmdError, match="message 0 must be"):
        get_chat_template("qwen").render([{"role": "robot", "content": "x"}])
    with pytest.raises(LmdError, match="at least one message"):
        get_chat_template("qwen").render([])
