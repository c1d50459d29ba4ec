"""Chat template registry: exact renders of the fixed formats, and ChatML / `hf` against SmolLM2's own template."""

from __future__ import annotations

import json

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


# ---- tools ----

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
CALL = {"id": "call_abcdefghijklmnopqrstuvwx", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": None, "tool_calls": [CALL]},
             {"role": "tool", "content": "18 C", "tool_call_id": CALL["id"]}]
SCHEMA = json.dumps(TOOLS[0])

# Qwen2.5-Instruct's own template (tokenizer_config.json), the reference for `qwen` with tools
QWEN25_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}"
    "{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided "
    "with function signatures within <tools></tools> XML tags:\\n<tools>\" }}{%- for tool in tools %}{{- \"\\n\" }}"
    "{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function call, return a json object with function "
    "name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, "
    "\\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}{%- else %}"
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- for message in messages %}"
    "{%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == "
    "\"assistant\" and not message.tool_calls) %}{{- '<|im_start|>' + message.role + '\\n' + message.content + "
    "'<|im_end|>' + '\\n' }}{%- elif message.role == \"assistant\" %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == \"tool\" %}{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}"
    "{{- '<|im_start|>user' }}{%- endif %}{{- '\\n<tool_response>\\n' }}{{- message.content }}"
    "{{- '\\n</tool_response>' }}{%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture()
def qwen25_tokenizer(tokenizer):
    import copy

    tok = copy.copy(tokenizer)
    tok.chat_template = QWEN25_TEMPLATE
    return tok


def test_qwen_tools_exact():
    text = get_chat_template("qwen").render(TOOL_CHAT, tools=TOOLS)
    assert text == (
        "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query."
        "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n" + SCHEMA +
        "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
        "</tool_call><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_qwen_and_hf_with_qwen25_template_agree(qwen25_tokenizer, tools):
    two_results = TOOL_CHAT + [{"role": "tool", "content": "dry", "tool_call_id": CALL["id"]}]
    reference = get_chat_template("hf").render(two_results, qwen25_tokenizer, tools=tools)
    assert get_chat_template("qwen").render(two_results, tools=tools) == reference
    assert get_chat_template("hf").tool_call_format(qwen25_tokenizer) == "hermes"
    assert get_chat_template("hf").renders_tools(qwen25_tokenizer)


def test_llama3_tools_exact():
    text = get_chat_template("llama3").render(TOOL_CHAT, tools=TOOLS)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\nCutting Knowledge Date: "
        "December 2023\nToday Date: 26 Jul 2024\n\nBe brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Given the following functions, please respond with a JSON for a function call with its proper arguments that "
        'best answers the given prompt.\n\nRespond in the format {"name": function name, "parameters": dictionary of '
        "argument name and its value}.Do not use variables.\n\n" + json.dumps(TOOLS[0], indent=4) + "\n\n"
        "Weather in Paris?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>'
        '<|start_header_id|>ipython<|end_header_id|>\n\n"18 C"<|eot_id|>'
        "<|start_header_id|>assistant<|end_header_id|>\n\n")
    with pytest.raises(LmdError, match="one tool call per assistant message"):
        get_chat_template("llama3").render(TOOL_CHAT[:2] + [{**TOOL_CHAT[2], "tool_calls": [CALL, CALL]}], tools=TOOLS)


def test_mistral_tools_exact():
    assert get_chat_template("mistral").render(TOOL_CHAT + [{"role": "user", "content": "Thanks"}], tools=TOOLS) == (
        '<s>[INST] Weather in Paris?[/INST][TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}, '
        '"id": "pqrstuvwx"}]</s>'  # the id's last 9 letters and digits

        '[TOOL_RESULTS] {"content": 18 C, "call_id": "pqrstuvwx"}[/TOOL_RESULTS]'
        '[AVAILABLE_TOOLS] [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a '
        'city", "parameters": ' + json.dumps(TOOLS[0]["function"]["parameters"]) + '}}][/AVAILABLE_TOOLS]'
        "[INST] Be brief.\n\nThanks[/INST]")
    with pytest.raises(LmdError, match="9 letters or digits"):
        get_chat_template("mistral").render([TOOL_CHAT[1], {**TOOL_CHAT[2], "tool_calls": [{**CALL, "id": "c1"}]}])


def test_templates_without_a_tool_format_refuse_tools(tokenizer):
    for name in ("llama2", "vicuna", "internlm", "base"):
        assert not get_chat_template(name).renders_tools()
        with pytest.raises(LmdError, match="no format for tools"):
            get_chat_template(name).render(CHAT, tools=TOOLS)
    # SmolLM2-135M-Instruct's own template never reads `tools`
    assert not get_chat_template("hf").renders_tools(tokenizer)
    assert get_chat_template("hf").tool_call_format(tokenizer) is None
    with pytest.raises(LmdError, match="does not render tools"):
        get_chat_template("hf").render(CHAT, tokenizer, tools=TOOLS)
    assert [get_chat_template(n).tool_call_format() for n in ("qwen", "llama3", "mistral")] == [
        "hermes", "llama3_json", "mistral"]


def test_tool_messages_are_checked():
    with pytest.raises(LmdError, match="tool_call_id"):
        get_chat_template("qwen").render([{"role": "tool", "content": "x"}])
    with pytest.raises(LmdError, match="tool_calls belong to an assistant"):
        get_chat_template("qwen").render([{"role": "user", "content": "x", "tool_calls": [CALL]}])
