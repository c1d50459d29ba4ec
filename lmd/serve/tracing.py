"""OpenTelemetry tracing of generation requests (`lmd serve --otlp-traces-endpoint URL`, vLLM's flag): one OTLP span
per /v1/chat/completions or /v1/completions request, exported over OTLP/HTTP (protobuf) by opentelemetry-sdk's batch
processor, so a request never waits on the collector.

The span ("llm_request", kind SERVER, vLLM's name) starts when the request arrives and ends when its last generation
finishes; its parent is the caller's W3C `traceparent` header, when sent. Events: queued, scheduled, first_token,
finished (the engine's own times, RequestTimes; over several prompts or samples: the earliest of each but finished,
the latest). Attributes: GenAI semantic-convention names (gen_ai.*) for the request's settings, token usage, finish
reasons and latencies, and lmd.usage.prefix_hit_tokens. Off by default: without the flag opentelemetry is never
imported and a request pays one `is None` check.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from lmd.errors import LmdError
from lmd.turbomind.gen_config import GenerationConfig
from lmd.turbomind.request_stream import Usage
from lmd.turbomind.request_times import RequestTimes

SPAN_NAME = "llm_request"
OTLP_TRACES_PATH = "/v1/traces"  # OTLP/HTTP's default path, added to a bare endpoint


def traces_url(endpoint: str) -> str:
    """The collector URL: `endpoint` as given, or with /v1/traces when it names no path."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise LmdError(f"--otlp-traces-endpoint {endpoint!r} is not an http(s) URL; give the collector's OTLP/HTTP "
                       "address, e.g. http://localhost:4318/v1/traces")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + OTLP_TRACES_PATH


@dataclass(frozen=True)
class TracedRequest:
    """What the server knows of one request when its span is written."""

    request_id: str
    endpoint: str
    model: str
    arrival: float  # time.time() when the request arrived
    config: GenerationConfig
    finish_reasons: tuple[str, ...]
    usage: Usage | None
    times: tuple[RequestTimes, ...]  # of the generations that reached the engine's end


class RequestTracer:
    def __init__(self, endpoint: str, service_name: str = "lmd") -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.url = traces_url(endpoint)
        self._provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("lmd.serve")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, headers: Mapping[str, str], request: TracedRequest) -> None:
        from opentelemetry.trace import SpanKind

        parent = self._propagator.extract(carrier={k.lower(): v for k, v in headers.items()})
        span = self._tracer.start_span(SPAN_NAME, context=parent, kind=SpanKind.SERVER,
                                       start_time=_ns(request.arrival))
        span.set_attributes(_attributes(request))
        events = _events(request.times)
        for name, at in events:
            span.add_event(name, timestamp=_ns(at))
        span.end(end_time=_ns(events[-1][1] if events and events[-1][0] == "finished" else time.time()))

    def force_flush(self, timeout_ms: int = 10_000) -> bool:
        return self._provider.force_flush(timeout_ms)

    def shutdown(self) -> None:
        self._provider.shutdown()


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _events(times: Sequence[RequestTimes]) -> list[tuple[str, float]]:
    if not times:
        return []
    firsts = {"queued": min(t.queued for t in times)}
    for name in ("scheduled", "first_token"):
        known = [getattr(t, name) for t in times if getattr(t, name) is not None]
        if known:
            firsts[name] = min(known)
    return [*firsts.items(), ("finished", max(t.finished for t in times))]


def _attributes(request: TracedRequest) -> dict[str, object]:
    config = request.config
    values: dict[str, object] = {
        "gen_ai.request.id": request.request_id,
        "gen_ai.response.model": request.model,
        "gen_ai.request.max_tokens": config.max_new_tokens,
        "gen_ai.request.temperature": config.temperature,
        "gen_ai.request.top_p": config.top_p,
        "gen_ai.request.n": config.n,
        "gen_ai.response.finish_reasons": list(request.finish_reasons),
        "http.route": request.endpoint,
    }
    if request.usage is not None:
        values |= {"gen_ai.usage.prompt_tokens": request.usage.prompt_tokens,
                   "gen_ai.usage.completion_tokens": request.usage.completion_tokens,
                   "lmd.usage.prefix_hit_tokens": request.usage.cached_tokens}
    events = dict(_events(request.times))
    if "scheduled" in events:
        values["gen_ai.latency.time_in_queue"] = events["scheduled"] - events["queued"]
    if "first_token" in events:
        values["gen_ai.latency.time_to_first_token"] = events["first_token"] - request.arrival
    if "finished" in events:
        values["gen_ai.latency.e2e"] = events["finished"] - request.arrival
    return values
