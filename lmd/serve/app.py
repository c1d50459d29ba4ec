"""`create_app(engine, model_name)`: the OpenAI-compatible FastAPI app over a running Engine.

The app never owns the engine: whoever built it starts and closes it (`lmd serve`, a test). Every request is one
`engine.generate` call whose request id is the response id; leaving the request early aborts it in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmd.chat_templates import TOOL_FORMATS, check_template_kwargs
from lmd.errors import LmdError
from lmd.serve.errors import ApiError, bad_request, install_error_handlers
from lmd.serve.generation import collect, engine_request_ids, merged, submit, summed_usage
from lmd.serve.messages import chat_messages
from lmd.serve.metrics import CHAT, COMPLETIONS, CONTENT_TYPE, LatencyHistograms, RequestCounts, render_metrics
from lmd.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from lmd.serve.reasoning import REASONING_PARSERS, ReasoningParser, starts_in_reasoning
from lmd.serve.responses import EchoedPrompt, ReasoningFactory, ResponseBuilder, new_request_id
from lmd.serve.sampling import generation_config
from lmd.serve.streaming import AbortingEventStream, sse_event, unless_disconnected
from lmd.serve.structured_outputs import StructuredOutput, compile_structured_output, request_structured_output
from lmd.serve.tools import ToolUse, tool_call_output, tool_use
from lmd.serve.tracing import RequestTracer, TracedRequest
from lmd.turbomind.engine import Engine
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Delta, RequestStream, Usage, best_by_logprob
from lmd.turbomind.request_stream import Response as EngineResponse

_log = logging.getLogger("lmd.serve")


class _Server:
    def __init__(self, engine: Engine, model_name: str, api_keys: Sequence[str], tool_call_parser: str | None,
                 tracer: RequestTracer | None = None, reasoning_parser: str | None = None) -> None:
        self.engine, self.model_name = engine, model_name
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser
        self.tracer = tracer
        self.api_keys = tuple(api_keys)
        self.counts = RequestCounts()
        self.latency = LatencyHistograms()
        self.created = int(time.time())
        self.in_flight: set[object] = set()  # engine request ids of responses still being produced

    def abort_all(self) -> None:
        """End every request in flight (server shutdown): their responses finish with finish_reason "abort"."""
        for request_id in list(self.in_flight):
            self.engine.abort(request_id)

    # ---- checks ----

    def check_api_key(self, request: Request) -> None:
        if not self.api_keys:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and any(secrets.compare_digest(token.strip(), k) for k in self.api_keys):
            return
        raise ApiError(
            401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'", code="invalid_api_key"
        )

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist; this server serves {self.model_name!r} (see GET /v1/models)",
                param="model",
                code="model_not_found",
            )

    # ---- models ----

    def model_card(self) -> dict[str, Any]:
        return {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "lmd",
            "max_model_len": self.engine.max_len,
        }

    # ---- generation ----

    def tool_use(self, body: ChatCompletionRequest) -> ToolUse:
        return tool_use(body, self.engine.chat_template, self.engine.tokenizer, self.tool_call_parser)

    def encode_messages(self, raw: list[ChatMessage], tools: list[dict[str, Any]] | None = None,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
        messages = chat_messages(raw)
        try:
            check_template_kwargs(self.engine.chat_template, template_kwargs)
        except LmdError as exc:
            raise bad_request("chat_template_kwargs", str(exc)) from None
        try:
            return self.engine.chat_template.encode(messages, self.engine.tokenizer, tools=tools,
                                                    template_kwargs=template_kwargs)
        except LmdError as exc:
            raise bad_request("messages", str(exc)) from None
        except Exception as exc:  # the tokenizer's own jinja template may refuse a conversation
            if not any(cls.__name__ == "TemplateError" for cls in type(exc).__mro__):
                raise
            raise bad_request("messages", f"the chat template refused these messages: {exc}") from None

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("prompt", "send exactly one of prompt (text) and messages (a conversation)")
        if body.messages is not None:
            ids = self.encode_messages(body.messages, template_kwargs=body.chat_template_kwargs)
        else:
            ids = list(self.engine.tokenizer(body.prompt, add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": self.engine.max_len, "tokens": ids}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_token_ids(body.tokens, "tokens")
        return {"prompt": self.engine.tokenizer.decode(body.tokens)}

    def check_token_ids(self, ids: list[int], field: str) -> None:
        vocab = self.engine.workspace.model.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(field, f"{field} token id {bad} is outside the vocabulary [0, {vocab})")

    def echoed(self, body: CompletionRequest, prompts: list[list[int]]) -> list[EchoedPrompt]:
        """What echo=true returns before each completion: the prompt as sent (token ids decoded) and its ids."""
        return [EchoedPrompt(raw if isinstance(raw, str) else self.engine.tokenizer.decode(ids), tuple(ids))
                for raw, ids in zip(body.prompts, prompts, strict=True)]

    def encode_completion(self, body: CompletionRequest) -> list[list[int]]:
        prompts = body.prompts
        out = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                out.append(self.engine.encode(prompt, apply_chat_template=False))
            else:
                self.check_token_ids(prompt, _prompt_field(i, len(prompts)))
                out.append(list(prompt))
        return out

    async def structured_output(self, body: ChatCompletionRequest | CompletionRequest,
                                tools: ToolUse | None) -> StructuredOutput | None:
        """The grammar the reply follows, compiled (cached per spec) in a worker thread: a first compile takes
        ~0.4 s, which must not stall the event loop."""
        output = request_structured_output(body)
        if tools is not None and tools.forced:
            if output is not None:
                raise bad_request("tool_choice", f"this tool_choice forces the reply to be tool calls and "
                                                 f"{output.field.split('.')[0]} asks for another format; send only "
                                                 "one of them")
            output = await asyncio.to_thread(tool_call_output, tools)
        if output is not None:
            await asyncio.to_thread(compile_structured_output, self.engine.grammar_compiler, output)
        return output

    def configs(self, body: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]],
                field: str, structured: StructuredOutput | None = None) -> list[GenerationConfig]:
        """Every prompt is checked (and its config made) before any is submitted."""
        configs = []
        for i, prompt_ids in enumerate(prompts):
            name = _prompt_field(i, len(prompts), field)
            if not prompt_ids:
                raise bad_request(name, f"{name} is empty; send some text or token ids")
            room = self.engine.max_len - len(prompt_ids)
            if room < 1:
                raise bad_request(name, f"{name} has {len(prompt_ids)} tokens; this server holds at most "
                                        f"{self.engine.max_len} per request (prompt + completion)")
            configs.append(generation_config(body, room, self.engine.workspace.model.vocab_size, structured))
        return configs

    def opens_reasoning(self, prompt: list[int]) -> bool | None:
        """With `--reasoning-parser`: whether the rendered chat prompt ends in an open start tag (the reply begins
        inside the reasoning); None without a parser."""
        if self.reasoning_parser is None:
            return None
        return starts_in_reasoning(self.engine.tokenizer.decode(prompt[-8:], skip_special_tokens=False),
                                   self.reasoning_parser)

    def reasoning(self, opened: bool | None, structured: StructuredOutput | None) -> ReasoningFactory | None:
        """Each choice's reasoning parser; a grammar (structured output, forced tool call) starts the reply outside
        the reasoning, whatever the prompt opened, since it allows none."""
        name = self.reasoning_parser
        if name is None or opened is None:
            return None
        inside = opened and structured is None
        return lambda: ReasoningParser(name, inside)

    async def generate(self, request: Request, body: ChatCompletionRequest | CompletionRequest,
                       prompts: list[list[int]], endpoint: str, tools: ToolUse | None = None,
                       opened_reasoning: bool | None = None) -> Response:
        arrival = time.time()
        chat = endpoint == CHAT
        field = "messages" if chat else "prompt"  # what a refused prompt's 400 names
        structured = await self.structured_output(body, tools)
        configs = self.configs(body, prompts, field, structured)
        if tools is not None:
            configs = [tools.configure(c, body) for c in configs]  # type: ignore[arg-type]
        response_id = new_request_id(chat)
        try:
            streams = submit(self.engine, prompts, configs, engine_request_ids(response_id, len(prompts)))
        except LmdError as exc:
            raise ApiError(503 if "closed" in str(exc) else 400, str(exc), field) from None
        ids = [stream.request_id for stream in streams]  # a prompt's samples are (id, i)
        samples, n = configs[0].num_samples, configs[0].n
        self.in_flight.update(ids)
        builder = ResponseBuilder(
            response_id,
            self.model_name,
            chat,
            self.engine.tokenizer,
            logprobs=configs[0].logprobs is not None,
            token_ids=body.return_token_ids,
            tool_parser=tools.new_parser if tools is not None and tools.parser is not None else None,
            echo=None if chat or not body.echo else self.echoed(body, prompts),  # type: ignore[union-attr]
            n=n,
            reasoning=self.reasoning(opened_reasoning, structured),
        )

        def abort_all() -> None:
            for request_id in ids:
                self.engine.abort(request_id)  # a no-op when the request already finished

        def trace(finals: Sequence[EngineResponse | Delta | None]) -> None:
            """Latency histograms and (when tracing) the request's span, from its generations' last deltas, one per
            engine request in order (None: it never ended here, e.g. the client left first)."""
            for final in finals:
                if final is not None:
                    self.latency.observe(arrival, final.times, final.usage)
            if self.tracer is not None:
                usage = summed_usage([None if f is None else f.usage for f in finals], samples)
                self.tracer.record(request.headers, TracedRequest(
                    response_id, endpoint, self.model_name, arrival, configs[0],
                    tuple("abort" if f is None or f.finish_reason is None else f.finish_reason for f in finals),
                    usage, tuple(f.times for f in finals if f is not None and f.times is not None)))

        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            reasons: dict[int, str] = {}

            finals: dict[int, Delta] = {}

            def on_close() -> None:
                abort_all()
                self.in_flight.difference_update(ids)
                for i in range(len(ids)):
                    self.counts.finish(endpoint, reasons.get(i))
                trace([finals.get(i) for i in range(len(ids))])

            return AbortingEventStream(self.events(streams, builder, include_usage, reasons, finals), on_close)
        gathered = asyncio.gather(*(collect(s) for s in streams))
        try:
            results = await unless_disconnected(request, gathered, abort_all)
        finally:
            self.in_flight.difference_update(ids)
        for i in range(len(ids)):
            self.counts.finish(endpoint, None if results is None else results[i].finish_reason)
        trace(results if results is not None else [None] * len(ids))
        if results is None:
            return Response(status_code=499)  # nobody is listening any more
        if any(r.finish_reason == "error" for r in results):
            raise self.engine_failure()
        usage = summed_usage([r.usage for r in results], samples)  # best_of: every sample generated counts
        # best_of: the n with the highest cumulative logprob, per prompt (n samples alone stay as they are)
        results = [r for p in range(0, len(results), samples) for r in best_by_logprob(results[p:p + samples], n)]
        return JSONResponse(builder.full(results, usage))

    async def events(self, streams: list[RequestStream], builder: ResponseBuilder, include_usage: bool,
                     reasons: dict[int, str], finals: dict[int, Delta]) -> AsyncIterator[str]:
        """`reasons`: how each prompt's generation ended (absent until its last delta: client gone, server
        stopped), for the counters; `finals`: the last delta of each (tracing)."""
        if builder.chat:
            for chunk in builder.role_chunks(len(streams), include_usage):
                yield sse_event(chunk)
        usages: list[Usage | None] = [None] * len(streams)
        async for index, delta in merged(streams):
            if delta.finish_reason is not None:
                finals[index] = delta
            if delta.finish_reason == "error":
                reasons[index] = "error"
                yield sse_event(self.engine_failure().body())
                break
            for chunk in builder.chunks(index, delta, include_usage):
                yield sse_event(chunk)
            if delta.finish_reason is not None:
                reasons[index], usages[index] = delta.finish_reason, delta.usage
        if include_usage and "error" not in reasons.values():
            yield sse_event(builder.usage_chunk(summed_usage(usages, builder.samples_per_prompt)))
        yield sse_event("[DONE]")

    def engine_failure(self) -> ApiError:
        error = self.engine.last_error
        if error is None:  # the request alone ended with an error (its grammar refused a token); see the log
            return ApiError(500, "the engine ended this request with an error (see the server log); retry it")
        _log.error("an engine step failed; its requests ended with an error", exc_info=error)
        return ApiError(500, f"the engine failed while generating: {error!r}; retry the request")


def _prompt_field(index: int, count: int, field: str = "prompt") -> str:
    """How errors name one prompt: `prompt` alone, `prompt.2` in a batch."""
    return field if count == 1 else f"{field}.{index}"


def create_app(engine: Engine, model_name: str, api_keys: Sequence[str] = (),
               tool_call_parser: str | None = None, otlp_traces_endpoint: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The HTTP app over `engine` (already running its step loop), serving it as `model_name`; `tool_call_parser`
    (one of TOOL_FORMATS) reads tool calls in replies instead of the chat template family's own format;
    `otlp_traces_endpoint`: export a span per generation request there (lmd.serve.tracing); the caller shuts the
    tracer down (`app.state.server.tracer`) when the app is done; `reasoning_parser` (one of REASONING_PARSERS)
    moves chat replies' thinking into `reasoning_content`."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_FORMATS:
        raise LmdError(f"tool call parser {tool_call_parser!r} is unknown; use one of {', '.join(TOOL_FORMATS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise LmdError(f"reasoning parser {reasoning_parser!r} is unknown; use one of {', '.join(REASONING_PARSERS)}")
    tracer = None if otlp_traces_endpoint is None else RequestTracer(otlp_traces_endpoint)
    server = _Server(engine, model_name, api_keys, tool_call_parser, tracer, reasoning_parser)
    app = FastAPI(title="lmd serve", summary="OpenAI-compatible API over the lmd engine", version="0.1.0")
    app.state.server = server
    install_error_handlers(app, server.counts.reject)
    authorized = [Depends(server.check_api_key)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = await asyncio.to_thread(engine.stats)  # a round trip to the engine process: off the event loop
        return PlainTextResponse(render_metrics(stats, server.counts, server.latency), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=authorized)
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [server.model_card()]}

    @app.get("/v1/models/{model:path}", dependencies=authorized)
    async def get_model(model: str) -> dict[str, Any]:
        server.check_model(model)
        return server.model_card()

    @app.post(CHAT, dependencies=authorized)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        tools = server.tool_use(body)
        prompt = server.encode_messages(body.messages, tools.tools, body.chat_template_kwargs)
        return await server.generate(request, body, [prompt], CHAT, tools, server.opens_reasoning(prompt))

    @app.post(COMPLETIONS, dependencies=authorized)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        return await server.generate(request, body, server.encode_completion(body), COMPLETIONS)

    @app.post("/tokenize", dependencies=authorized)
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        server.check_model(body.model)
        return server.tokenize(body)

    @app.post("/detokenize", dependencies=authorized)
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        server.check_model(body.model)
        return server.detokenize(body)

    return app
