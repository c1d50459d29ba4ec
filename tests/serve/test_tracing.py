"""OpenTelemetry tracing (`create_app(..., otlp_traces_endpoint=URL)`): a span per generation request exported over
OTLP/HTTP to an in-process receiver, with the caller's traceparent as parent, the request's events in order and its
usage and finish reasons as attributes; no span without tracing; bad endpoints refused."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from lmd.errors import LmdError
from tests.serve.conftest import MODEL

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"


class _Receiver(BaseHTTPRequestHandler):
    spans: list = []

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        body = self.rfile.read(int(self.headers["Content-Length"]))
        export = ExportTraceServiceRequest.FromString(body)
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                _Receiver.spans.extend(scope.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def receiver():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def traced(engine, receiver):
    from fastapi.testclient import TestClient

    from lmd.serve.app import create_app

    app = create_app(engine, MODEL, otlp_traces_endpoint=receiver)
    with TestClient(app) as test_client:
        yield test_client, app.state.server.tracer
    app.state.server.tracer.shutdown()


def _attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = [v.string_value for v in value.array_value.values] if kind == "array_value" else getattr(
            value, kind)
    return out


@pytest.mark.parametrize("stream", [False, True])
def test_a_span_per_request_with_parent_events_and_usage(traced, stream):
    client, tracer = traced
    _Receiver.spans.clear()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    response = client.post("/v1/chat/completions", json=body, headers={"traceparent": TRACEPARENT})
    assert response.status_code == 200
    assert tracer.force_flush()
    (span,) = _Receiver.spans
    assert span.name == "llm_request"
    assert span.trace_id.hex() == TRACE_ID and span.parent_span_id.hex() == PARENT_ID
    assert [e.name for e in span.events] == ["queued", "scheduled", "first_token", "finished"]
    stamps = [e.time_unix_nano for e in span.events]
    assert stamps == sorted(stamps) and span.start_time_unix_nano <= stamps[0] and stamps[-1] == span.end_time_unix_nano
    attrs = _attrs(span)
    assert attrs["gen_ai.usage.completion_tokens"] == 5 and attrs["gen_ai.usage.prompt_tokens"] > 0
    assert attrs["gen_ai.response.finish_reasons"] == ["length"] and attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.id"].startswith("chatcmpl-") and attrs["http.route"] == "/v1/chat/completions"
    assert 0 <= attrs["gen_ai.latency.time_to_first_token"] <= attrs["gen_ai.latency.e2e"]


def test_samples_and_prompts_make_one_span_without_a_parent(traced):
    client, tracer = traced
    _Receiver.spans.clear()
    body = {"model": MODEL, "prompt": ["Once", "upon a"], "max_tokens": 3, "n": 2, "temperature": 1.0, "seed": 3}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert tracer.force_flush()
    (span,) = _Receiver.spans
    attrs = _attrs(span)
    assert span.parent_span_id == b"" and len(attrs["gen_ai.response.finish_reasons"]) == 4
    assert attrs["gen_ai.usage.completion_tokens"] <= 12 and attrs["gen_ai.request.n"] == 2


def test_without_tracing_no_tracer_and_bad_endpoints_refused(client):
    from lmd.serve.tracing import traces_url

    assert client.app.state.server.tracer is None
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("https://c/api/traces") == "https://c/api/traces"
    with pytest.raises(LmdError, match="not an http"):
        traces_url("collector:4318")
