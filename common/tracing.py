"""Tracing setup for every process, from the standard OpenTelemetry environment variables,
and W3C trace-context propagation through our msgpack messages.

Exporter choice (``OTEL_TRACES_EXPORTER``, comma-separated):
  ``otlp``            the official OTLP exporter; ``OTEL_EXPORTER_OTLP_PROTOCOL`` picks
                      ``http/protobuf`` (default) or ``grpc``; endpoint from
                      ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
  ``otlp_json_file``  OTLP-JSON lines appended to ``TS_SPANS_FILE`` (the official
                      opentelemetry-exporter-otlp-json-file), for machines without a backend;
  ``console``         to stdout; ``none``: no export.
Unset: ``otlp`` when an OTLP endpoint is set, else ``otlp_json_file`` when ``TS_SPANS_FILE``
is set, else nothing is installed (the API's no-op tracer, at almost no cost).
``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER(_ARG)`` and
``OTEL_BSP_*`` are honoured by the SDK itself. Spans are exported in batches off the
hot path (BatchSpanProcessor), so tracing does not slow the step loop.
"""

from __future__ import annotations

import os

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject

SPANS_FILE_ENV = "TS_SPANS_FILE"

# Attribute names every span of a request carries, so Jaeger can search by them.
REQUEST_ID = "request.id"
REQUEST_TIER = "request.tier"
TENANT_ID = "tenant.id"


def setup_tracing(default_service_name: str) -> trace.TracerProvider | None:
    """Install the process's tracer provider as the environment says; None when tracing is off."""
    if os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return None
    names = _exporter_names()
    if not names:
        return None
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", default_service_name)})
    provider = TracerProvider(resource=resource)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    trace.set_tracer_provider(provider)
    return provider


def _exporter_names() -> list[str]:
    raw = os.environ.get("OTEL_TRACES_EXPORTER")
    if raw is not None:
        return [n.strip() for n in raw.split(",") if n.strip() and n.strip() != "none"]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return ["otlp"]
    if os.environ.get(SPANS_FILE_ENV):
        return ["otlp_json_file"]
    return []


def _exporter(name: str):
    if name == "otlp":
        protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
                                  os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"))
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        elif protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        else:
            raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
        return OTLPSpanExporter()
    if name == "otlp_json_file":
        from opentelemetry.exporter.otlp.json.file import FileSpanExporter

        path = os.environ.get(SPANS_FILE_ENV)
        if not path:
            raise ValueError(f"OTEL_TRACES_EXPORTER=otlp_json_file needs {SPANS_FILE_ENV}")
        from common.spans_file import AppendStream

        # Several processes append to one file: each batch is a single write(2), which O_APPEND keeps whole on a
        # local file system, to the file the path names now (up.py rotates it by size).
        return FileSpanExporter(stream=AppendStream(path))
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    raise ValueError(f"OTEL_TRACES_EXPORTER: unknown exporter {name!r} (otlp, otlp_json_file, console, none)")


def carrier() -> dict[str, str]:
    """The current context as W3C headers (traceparent, tracestate), to put into a message."""
    out: dict[str, str] = {}
    inject(out)
    return out


def context_from(headers: dict[str, str] | None) -> otel_context.Context:
    """The context a message carried (an empty context if none or malformed: a new trace starts)."""
    return extract(headers or {})


def request_attributes(request_id: str, tier: str, tenant: str | None) -> dict[str, str]:
    attrs = {REQUEST_ID: request_id, REQUEST_TIER: tier}
    if tenant:
        attrs[TENANT_ID] = tenant
    return attrs


def carrier_of(span: trace.Span) -> dict[str, str]:
    """W3C headers naming ``span`` as the parent."""
    out: dict[str, str] = {}
    inject(out, context=trace.set_span_in_context(span))
    return out
