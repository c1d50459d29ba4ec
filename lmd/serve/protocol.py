"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Pydantic checks types (its errors become 400s naming the field); ranges are GenerationConfig's job, so each limit
has one definition. Fields the server cannot honour are refused by `unsupported()` rather than silently ignored;
fields that do not change the output (user, metadata, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the call's arguments: a JSON object, as text")


class ToolCallMessage(BaseModel):
    """A call an earlier assistant turn made, sent back as part of the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallMessage] | None = None  # assistant
    tool_call_id: str | None = None  # tool: the call this message answers


class FunctionDefinition(BaseModel):
    name: str = Field(description="letters, digits, '_' and '-', at most 64")
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaSpec(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema", description="the JSON schema of the reply")
    strict: bool | None = Field(None, description="false still constrains the reply, as vLLM does")


class ResponseFormat(BaseModel):
    type: str = Field(description="text, json_object or json_schema")
    json_schema: JsonSchemaSpec | None = None


class SamplingRequest(BaseModel):
    """Fields shared by /v1/chat/completions and /v1/completions (OpenAI's names, plus vLLM/LMDeploy extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # extension; 0 or -1: off
    repetition_penalty: float = 1.0  # extension
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    seed: int | None = None
    n: int | None = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int | None = None  # extension (vLLM)
    min_new_tokens: int | None = None  # extension (LMDeploy)
    skip_special_tokens: bool = True  # extension
    return_token_ids: bool = False  # extension: each choice also carries the generated token ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string, OpenAI's JSON) -> bias in [-100, 100]
    min_p: float = 0.0  # extension (vLLM)
    best_of: int | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = Field(None, description="extension (vLLM): a JSON schema the reply "
                                                                       "follows")
    guided_regex: str | None = Field(None, description="extension (vLLM): a regex the reply matches")
    guided_choice: list[str] | None = Field(None, description="extension (vLLM): the reply is one of these")
    guided_grammar: str | None = Field(None, description="extension (vLLM): an EBNF grammar (root rule `root`)")
    use_beam_search: bool = Field(False, description="extension (vLLM): beam search, best_of (or n) beams wide, "
                                                     "the n best returned; needs temperature=0")
    length_penalty: float = Field(1.0, description="extension (vLLM, with use_beam_search): beams are ranked by "
                                                   "cumulative logprob / length ** length_penalty")
    early_stopping: bool | Literal["never"] = Field(False, description="extension (vLLM, with use_beam_search)")

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for the first option this server cannot honour, or None."""
        if self.use_beam_search and self.stream:
            return "use_beam_search", ("use_beam_search cannot be streamed (the best beams are known only at the "
                                       "end); send stream=false")
        if self.use_beam_search and max(self.n or 1, self.best_of or 1) < 2:
            return "use_beam_search", "use_beam_search needs best_of (the beam width) or n of at least 2"
        if not self.use_beam_search and (self.length_penalty != 1.0 or self.early_stopping is not False):
            field = "length_penalty" if self.length_penalty != 1.0 else "early_stopping"
            return field, f"{field} applies to beam search only; send use_beam_search=true or leave it out"
        if self.best_of is not None and self.best_of > (self.n or 1) and self.stream:
            return "best_of", "best_of cannot be streamed (the best are known only at the end); send stream=false"
        if self.stream_options is not None and not self.stream:
            return "stream_options", "stream_options is only allowed with stream=true"
        if self.min_tokens is not None and self.min_new_tokens is not None and self.min_tokens != self.min_new_tokens:
            return "min_tokens", "min_tokens and min_new_tokens disagree; send only one of them"
        return None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without")
    parallel_tool_calls: bool = Field(True, description="false: at most one call per reply")
    functions: list[Any] | None = None  # OpenAI's deprecated form of tools
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extra variables for the tokenizer's chat template (e.g. {\"enable_thinking\": false})")
    function_call: Any = None

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is not None:
            return found
        for name in ("functions", "function_call"):
            if getattr(self, name) is not None:
                return name, f"{name} (OpenAI's deprecated function calling) is not supported; send tools and tool_choice"
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs", "top_logprobs needs logprobs=true"
        limits = (self.max_tokens, self.max_completion_tokens)
        if None not in limits and limits[0] != limits[1]:
            return "max_tokens", "max_tokens and max_completion_tokens disagree; send only one of them"
        return None

    @property
    def token_limit(self) -> tuple[str, int | None]:
        """(the field that set the limit, its value)."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return "max_tokens", self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        found = super().unsupported()
        if found is not None:
            return found
        if self.suffix:
            return "suffix", "suffix (insertion) is not supported; leave it out"
        return None

    @property
    def prompts(self) -> list[str | list[int]]:
        """OpenAI's four prompt forms as a list of prompts: a string, token ids, a list of strings, a list of token-id
        lists (an empty list is one empty prompt, refused as such)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt or isinstance(prompt[0], int):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]

    @property
    def token_limit(self) -> tuple[str, int | None]:
        return "max_tokens", self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt or chat messages (exactly one)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt form: the tokenizer's BOS etc., as /v1/completions encodes it
    chat_template_kwargs: dict[str, Any] | None = None  # messages form: as /v1/chat/completions takes them


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
