"""The caller's OpenTelemetry context, captured when a job is staged.

:func:`capture` is what :func:`drain.stage` and :func:`drain.stage_many` store
in ``staged_jobs.trace``: the carrier OpenTelemetry's configured propagators
(W3C ``traceparent`` and ``tracestate``, ``baggage`` by default) write for the
current context, as JSON text. The drain hands it on in the message's headers,
where Celery's instrumentation reads it (docs/tracing.md), so the worker's
span joins the trace of the request that staged the job.

OpenTelemetry is optional (the ``otel`` extra). Where the application never
imported ``opentelemetry.context`` there cannot be a current context: nothing
is imported and nothing is captured. With the API but no span and no baggage
(no SDK, or outside any span) the context is empty and nothing is stored.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from drain.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

#: The environment variables that turn drain's own spans on (any of them set).
SDK_VARIABLES = ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT",
                 "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def capture() -> str | None:
    """The current context as the propagators' carrier, JSON text; None: no context.

    Tracing never stops a job from being staged: a propagator that fails (a
    custom one) or writes what JSON cannot hold gives the job no context."""
    context = sys.modules.get("opentelemetry.context")
    if context is None:
        return None  # OpenTelemetry never imported: no context can be current
    try:
        current = context.get_current()
        if not current:
            return None
        return _column_value(current)
    except Exception:  # see the docstring
        return None


def _column_value(context: Any) -> str | None:
    """What the propagators write for ``context``, as a ``trace`` column value
    (JSON text); None when they write nothing."""
    from opentelemetry import propagate  # noqa: PLC0415 - optional, loaded already

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return json.dumps(carrier, separators=(",", ":")) if carrier else None


def configured_tracer() -> Tracer | None:
    """The drain's tracer when the standard ``OTEL_*`` variables ask for spans.

    Spans are recorded when one of :data:`SDK_VARIABLES` is set (and
    ``OTEL_TRACES_EXPORTER`` is not ``none``, ``OTEL_SDK_DISABLED`` not
    ``true``). A tracer provider already set (``opentelemetry-instrument drain
    run``) is used as it is; otherwise the drain sets one up as the SDK's
    auto-configuration would: the resource from ``OTEL_SERVICE_NAME`` and
    ``OTEL_RESOURCE_ATTRIBUTES`` (service.name ``drain`` by default), the
    sampler from ``OTEL_TRACES_SAMPLER``, and a batch span processor per
    exporter named in ``OTEL_TRACES_EXPORTER`` (``otlp`` by default: the OTLP
    exporter installed, configured by ``OTEL_EXPORTER_OTLP_*``).
    """
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if not any(os.environ.get(name, "").strip() for name in SDK_VARIABLES):
        return None
    names = [n.strip() for n in os.environ.get("OTEL_TRACES_EXPORTER", "otlp").split(",")
             if n.strip()] or ["otlp"]
    if names == ["none"]:
        return None
    try:
        from opentelemetry import trace  # noqa: PLC0415 - the otel extra
        from opentelemetry.sdk.resources import Resource  # noqa: PLC0415
        from opentelemetry.sdk.trace import TracerProvider  # noqa: PLC0415
        from opentelemetry.sdk.trace.export import BatchSpanProcessor  # noqa: PLC0415
    except ImportError:
        raise ConfigError(
            f"{_set_variable()} is set but the OpenTelemetry SDK is not installed: "
            "pip install 'drain-outbox[otel]' (or unset it)") from None
    from drain.version import VERSION  # noqa: PLC0415

    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        given = os.environ.get("OTEL_SERVICE_NAME", "").strip() or (
            "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", ""))
        provider = TracerProvider(resource=Resource.create(
            {} if given else {"service.name": "drain"}))
        for name in names:
            if name != "none":
                provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
        trace.set_tracer_provider(provider)
    return provider.get_tracer("drain", VERSION)


def _exporter(name: str) -> Any:
    """The span exporter registered under ``name`` (OTEL_TRACES_EXPORTER's names)."""
    from importlib.metadata import entry_points  # noqa: PLC0415

    found = {e.name: e for e in entry_points(group="opentelemetry_traces_exporter")}
    # "otlp" is the default name; the HTTP exporter registers "otlp_proto_http".
    entry = found.get(name) or (found.get("otlp_proto_http") if name == "otlp" else None)
    if entry is None:
        raise ConfigError(
            f"OTEL_TRACES_EXPORTER names {name!r}, which no installed package provides "
            f"(installed: {', '.join(sorted(found)) or 'none'}); "
            "pip install 'drain-outbox[otel]' brings the OTLP exporter")
    return entry.load()()


def _set_variable() -> str:
    return next(name for name in SDK_VARIABLES if os.environ.get(name, "").strip())


@contextlib.contextmanager
def run_span(kind: str, run_id: str, run_token: str) -> Iterator[str | None]:
    """A span for one run of a backfill (``kind`` ``backfill``), the root of its
    own trace: yields its context as a ``trace`` column value (JSON text), the
    same for every job the run stages, so that they are found together. None,
    and no span, without the SDK configured (:func:`configured_tracer`)."""
    tracer = configured_tracer()
    if tracer is None:
        yield None
        return
    from opentelemetry import context, trace  # noqa: PLC0415 - the otel extra

    span = tracer.start_span(f"{kind} {run_id}", context=context.Context(),
                             kind=trace.SpanKind.INTERNAL,
                             attributes={f"drain.{kind}.id": run_id,
                                         f"drain.{kind}.run_token": run_token})
    try:
        with trace.use_span(span, end_on_exit=True, record_exception=True,
                            set_status_on_exception=True):
            yield _column_value(trace.set_span_in_context(span))
    finally:
        provider = trace.get_tracer_provider()
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            flush()
