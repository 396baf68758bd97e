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

import json
import sys

#: The column's keys the drain reads; anything else a propagator writes is kept
#: in the column but not sent (drain.daemon.tracing).
CARRIER_KEYS = ("traceparent", "tracestate", "baggage")


def capture() -> str | None:
    """The current context as the propagators' carrier, JSON text; None: no context."""
    context = sys.modules.get("opentelemetry.context")
    if context is None:
        return None  # OpenTelemetry never imported: no context can be current
    current = context.get_current()
    if not current:
        return None
    from opentelemetry import propagate  # noqa: PLC0415 - optional, and loaded already

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=current)
    return json.dumps(carrier, separators=(",", ":")) if carrier else None
