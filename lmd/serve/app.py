"""`create_app(engine, model_name)`: the OpenAI-compatible FastAPI app over a running Engine.

The app never owns the engine: whoever built it starts and closes it (`lmd serve`, a test). Every request is one
`engine.generate` call whose request id is the response id; leaving the request early aborts it in the engine.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from lmd.errors import LmdError
from lmd.serve.errors import ApiError, bad_request, install_error_handlers
from lmd.serve.metrics import CHAT, COMPLETIONS, CONTENT_TYPE, RequestCounts, render_metrics
from lmd.serve.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from lmd.serve.responses import ResponseBuilder, new_request_id
from lmd.serve.sampling import chat_messages, generation_config
from lmd.serve.streaming import AbortingEventStream, sse_event, unless_disconnected
from lmd.turbomind.engine import Engine
from lmd.turbomind.request_stream import RequestStream
from lmd.turbomind.request_stream import Response as EngineResponse

_log = logging.getLogger("lmd.serve")


@dataclass
class _Outcome:
    """How a streamed request ended, for the counters (None until its last delta: client gone or server stopped)."""

    reason: str | None = None


class _Server:
    def __init__(self, engine: Engine, model_name: str, api_keys: Sequence[str]) -> None:
        self.engine, self.model_name = engine, model_name
        self.api_keys = tuple(api_keys)
        self.counts = RequestCounts()
        self.created = int(time.time())
        self.in_flight: set[str] = set()  # request ids of responses still being produced

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

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        return self.encode_messages(body.messages)

    def encode_messages(self, raw: list[ChatMessage]) -> list[int]:
        messages = chat_messages(raw)
        try:
            return self.engine.encode(messages)
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
            ids = self.encode_messages(body.messages)
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

    def encode_completion(self, body: CompletionRequest) -> list[int]:
        prompt = body.single_prompt
        if isinstance(prompt, str):
            return self.engine.encode(prompt, apply_chat_template=False)
        self.check_token_ids(prompt, "prompt")
        return list(prompt)

    async def generate(
        self, request: Request, body: ChatCompletionRequest | CompletionRequest, prompt_ids: list[int], endpoint: str
    ) -> Response:
        chat = endpoint == CHAT
        prompt_field = "messages" if chat else "prompt"
        if not prompt_ids:
            raise bad_request(prompt_field, f"{prompt_field} is empty; send some text or token ids")
        room = self.engine.max_len - len(prompt_ids)
        if room < 1:
            raise bad_request(
                prompt_field,
                f"{prompt_field} has {len(prompt_ids)} tokens; this server holds at "
                f"most {self.engine.max_len} per request (prompt + completion)",
            )
        config = generation_config(body, room, self.engine.workspace.model.vocab_size)
        request_id = new_request_id(chat)
        try:
            stream = self.engine.generate(prompt_ids, config, request_id=request_id)
        except LmdError as exc:
            raise ApiError(503 if "closed" in str(exc) else 400, str(exc), prompt_field) from None
        self.in_flight.add(request_id)
        builder = ResponseBuilder(
            request_id,
            self.model_name,
            chat,
            self.engine.tokenizer,
            logprobs=config.logprobs is not None,
            token_ids=body.return_token_ids,
        )
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            outcome = _Outcome()

            def on_close() -> None:
                self.engine.abort(request_id)  # a no-op when the request already finished
                self.in_flight.discard(request_id)
                self.counts.finish(endpoint, outcome.reason)

            return AbortingEventStream(self.events(stream, builder, include_usage, outcome), on_close)
        try:
            result = await unless_disconnected(request, _collect(stream), lambda: self.engine.abort(request_id))
        finally:
            self.in_flight.discard(request_id)
        self.counts.finish(endpoint, None if result is None else result.finish_reason)
        if result is None:
            return Response(status_code=499)  # nobody is listening any more
        if result.finish_reason == "error":
            raise self.engine_failure()
        return JSONResponse(builder.full(result))

    async def events(
        self, stream: RequestStream, builder: ResponseBuilder, include_usage: bool, outcome: _Outcome
    ) -> AsyncIterator[str]:
        if builder.chat:
            yield sse_event(builder.role_chunk(include_usage))
        usage = None
        async for delta in stream:
            if delta.finish_reason == "error":
                outcome.reason = "error"
                yield sse_event(self.engine_failure().body())
                break
            chunk = builder.chunk(delta, include_usage)
            if chunk is not None:
                yield sse_event(chunk)
            if delta.finish_reason is not None:
                outcome.reason, usage = delta.finish_reason, delta.usage
        if include_usage and outcome.reason != "error":
            yield sse_event(builder.usage_chunk(usage))
        yield sse_event("[DONE]")

    def engine_failure(self) -> ApiError:
        error = self.engine.last_error
        _log.error("an engine step failed; its requests ended with an error", exc_info=error)
        return ApiError(500, f"the engine failed while generating: {error!r}; retry the request")


async def _collect(stream: RequestStream) -> EngineResponse:
    response = EngineResponse(stream.request_id)
    async for delta in stream:
        response.add(delta)
    return response


def create_app(engine: Engine, model_name: str, api_keys: Sequence[str] = ()) -> FastAPI:
    """The HTTP app over `engine` (already running its step loop), serving it as `model_name`."""
    server = _Server(engine, model_name, api_keys)
    app = FastAPI(title="lmd serve", summary="OpenAI-compatible API over the lmd engine", version="0.1.0")
    app.state.server = server
    install_error_handlers(app, server.counts.reject)
    authorized = [Depends(server.check_api_key)]

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(render_metrics(engine.stats(), server.counts), media_type=CONTENT_TYPE)

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
        return await server.generate(request, body, server.encode_chat(body), CHAT)

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
