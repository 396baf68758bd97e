"""OpenTelemetry on the drain's side: each job's context from staging to the broker.

A row staged inside a span carries that span's context in ``staged_jobs.trace``
(drain.trace_context). The drain sends it on in the message's headers
(``traceparent``, ``tracestate``, ``baggage``), where Celery's instrumentation
reads it, so the worker's ``run/<task>`` span joins the trace of the request
that staged the job. How (``--trace-context``, docs/tracing.md):

* ``child`` (the default): the message continues the staging trace;
* ``link``: the message starts a new trace with a link to the staging context;
* ``none``: the staging context is not used.

Whatever the setting, a job staged more than ``--trace-new-after`` seconds ago
(a long delay, an outage) and a job requeued from dead_jobs (``drain.link`` in
its carrier) start a new trace linked to the staging context: no trace spans
hours or days.

With the SDK configured by the standard ``OTEL_*`` variables
(:func:`drain.trace_context.configured_tracer`), the drain also records a
producer span per message, ``publish <queue>`` (OpenTelemetry's messaging
conventions: destination, message id = task id, body size, and how long the
job waited in staged_jobs), the worker's span becomes its child, and a ``drain
batch`` span links the messages it published. Without the SDK the drain records nothing and forwards
the staging headers as they are (``child``) or sends none (``link``/``none``,
which need a span to link from); a row staged without a context gets none.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from typing import TYPE_CHECKING

from drain.celery.message import Destination
from drain.postgres.rows import StagedRow

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer
    from prometheus_client import Histogram

log = logging.getLogger("drain.tracing")

#: The carrier key `drain dead requeue` adds: a new trace, linked (its value is the reason).
LINK_KEY = "drain.link"
#: W3C limits: a tracestate longer than this may be dropped (vendors must pass on
#: at least 512 characters); a baggage header holds at most 8,192 bytes.
MAX_TRACESTATE = 512
MAX_BAGGAGE = 8192
#: version-trace id-parent id-flags, lower-case hex; version ff, an all-zero trace id
#: or parent id are invalid (W3C Trace Context).
_TRACEPARENT = re.compile(
    r"(?!ff)[0-9a-f]{2}-(?!0{32})[0-9a-f]{32}-(?!0{16})[0-9a-f]{16}-[0-9a-f]{2}")
#: A column holding a traceparent alone, as jsonb prints it: read without json.loads.
_ALONE = re.compile(r'\{"traceparent": "(' + _TRACEPARENT.pattern + r')"\}')
#: The last hex digit of a traceparent whose sampled flag (bit 0) is set.
_SAMPLED = frozenset("13579bdf")


def carrier(trace_json: str | None) -> dict[str, str] | None:
    """The headers a row's ``trace`` column can give: a well-formed traceparent,
    and tracestate and baggage within the W3C limits, as strings; anything else
    (another key, a value of another type, an oversized one) is left out, so
    that an odd value staged by SQL costs that job its context, nothing more.
    ``drain.link`` is kept with a traceparent. None: nothing usable."""
    if trace_json is None:
        return None
    alone = _ALONE.fullmatch(trace_json)  # what stage() writes, in jsonb's spelling
    if alone is not None:
        return {"traceparent": alone[1]}
    try:
        found = json.loads(trace_json)
    except ValueError:
        return None
    if not isinstance(found, dict):
        return None
    kept: dict[str, str] = {}
    parent = found.get("traceparent")
    if isinstance(parent, str) and _TRACEPARENT.fullmatch(parent):
        kept["traceparent"] = parent
        state = found.get("tracestate")
        if isinstance(state, str) and state and len(state.encode()) <= MAX_TRACESTATE:
            kept["tracestate"] = state
    baggage = found.get("baggage")
    if isinstance(baggage, str) and baggage and len(baggage.encode()) <= MAX_BAGGAGE:
        kept["baggage"] = baggage
    link = found.get(LINK_KEY)
    if "traceparent" in kept and isinstance(link, str):  # a link needs a span to link to
        kept[LINK_KEY] = link
    return kept or None


def sampled_trace_id(headers: dict[str, str] | None) -> str | None:
    """The trace id of a sampled traceparent (an exemplar worth showing), else None."""
    parent = None if headers is None else headers.get("traceparent")
    if parent is None or parent[-1] not in _SAMPLED:
        return None
    return parent[3:35]


@dataclasses.dataclass(slots=True)
class Traced:
    """One message's context: the headers to send and, with the SDK, its span."""

    headers: dict[str, str] | None
    span: Span | None = None


class Tracing:
    """What the drain does with the staging contexts (see the module's docstring)."""

    def __init__(self, mode: str = "child", new_after: float = 300.0,
                 tracer: Tracer | None = None, *,
                 unsampled_parents_dropped: bool | None = None) -> None:
        self.mode = mode
        self.new_after = new_after
        #: The SDK's tracer; None: record nothing, forward headers (``child``).
        self.tracer = tracer
        #: The sampler never records a span whose remote parent was not sampled (the
        #: SDK's parent-based samplers): such a job's headers are forwarded as they
        #: are, with no span made only to be dropped (the cost of sampling 1 %).
        self.unsampled_parents_dropped = (
            _drops_unsampled_parents(tracer) if unsampled_parents_dropped is None
            else unsampled_parents_dropped)
        self._batch: Span | None = None
        #: The current batch's longest-waiting row, and the trace its message joined.
        self._oldest: StagedRow | None = None
        self._oldest_trace: str | None = None
        self._failed = False
        #: Whether any row of the current batch is traced (begin_batch() says): without
        #: the SDK, only rows staged with a context, and none when contexts are
        #: dropped (``--trace-context none``). When not, :meth:`message` need not be
        #: asked per row.
        self.batch_traced = True

    def begin_batch(self, rows: list[StagedRow]) -> None:
        self._oldest = oldest_due(rows)
        self._oldest_trace = None
        self.batch_traced = self.tracer is not None or (
            self.mode != "none" and any(row.trace_json is not None for row in rows))
        if self.tracer is not None:
            from opentelemetry import context, trace  # noqa: PLC0415 - the SDK's, optional

            self._batch = self.tracer.start_span(
                "drain batch", context=context.Context(), kind=trace.SpanKind.INTERNAL)

    def end_batch(self, published: int, waits: Histogram) -> None:
        """End the batch's span and observe its longest wait in staged_jobs, with
        that job's sampled trace (or the batch's) as the exemplar."""
        batch, self._batch = self._batch, None
        trace_id = self._oldest_trace
        if batch is not None:
            batch.set_attribute("messaging.batch.message_count", published)
            batch.end()
            context = batch.get_span_context()
            if trace_id is None and context.trace_flags.sampled:
                trace_id = format(context.trace_id, "032x")
        oldest, self._oldest = self._oldest, None
        if oldest is None or oldest.due_epoch is None:
            return
        waits.observe(max(time.time() - oldest.due_epoch, 0.0),
                      None if trace_id is None else {"trace_id": trace_id})

    def message(self, row: StagedRow, destination: Destination | None,
                now: float) -> Traced | None:
        """Start a message's tracing; None (the fast path): no context, no SDK.

        A fault in tracing costs the job its context, never its message: it is
        sent without one (and the first such fault is logged)."""
        try:
            return self._message(row, destination, now)
        except Exception:
            if not self._failed:
                self._failed = True
                log.exception("tracing failed for a job (task id %s): it is sent without "
                              "its trace context (logged once)", row.task_id)
            return None

    def _message(self, row: StagedRow, destination: Destination | None,
                 now: float) -> Traced | None:
        trace_json = row.trace_json
        if trace_json is None or self.mode == "none":
            if self.tracer is None:
                return None
            staged = None
        else:
            staged = carrier(trace_json)
        reason = None if staged is None else self._link_reason(
            staged, 0.0 if row.staged_epoch is None else now - row.staged_epoch)
        if self.tracer is None or (
                reason is None and staged is not None and self.unsampled_parents_dropped
                and staged.get("traceparent", "1")[-1] not in _SAMPLED):
            if staged is None or reason is not None:
                return None
            traced = Traced(staged)  # without a reason to link, no drain.link in it
        else:
            traced = self._start_span(row, staged, reason, destination, now)
        if row is self._oldest:
            self._oldest_trace = sampled_trace_id(traced.headers)
        return traced

    def _link_reason(self, staged: dict[str, str], since_staged: float) -> str | None:
        """Why the message starts a new trace linked to ``staged`` (None: it continues it)."""
        if "traceparent" not in staged:
            return None
        if LINK_KEY in staged:
            return staged[LINK_KEY]
        if since_staged > self.new_after:
            return "waited"
        return "link" if self.mode == "link" else None

    def _start_span(self, row: StagedRow, staged: dict[str, str] | None, reason: str | None,
                    destination: Destination | None, now: float) -> Traced:
        """The message's producer span, a child of the staging context or (``reason``)
        the root of a new trace linked to it; ``destination``: where the app sends it
        (None: the row's own queue through the default exchange)."""
        queue, exchange, routing_key = ((row.queue, "", row.queue) if destination is None else
                                        (destination.queue, destination.exchange,
                                         destination.routing_key))
        from opentelemetry import context, propagate, trace  # noqa: PLC0415 - optional

        assert self.tracer is not None
        # The propagators read their own keys only: drain.link is left alone.
        parent = propagate.extract(staged) if staged is not None else context.Context()
        links = []
        if reason is not None:
            staging_span = trace.get_current_span(parent).get_span_context()
            links.append(trace.Link(staging_span, {"drain.link.reason": reason}))
            # A new trace, but the staging context's baggage goes on.
            parent = trace.set_span_in_context(trace.INVALID_SPAN, parent)
        span = self.tracer.start_span(
            f"publish {queue}", context=parent, kind=trace.SpanKind.PRODUCER, links=links,
            attributes={
                "messaging.system": "rabbitmq",
                "messaging.operation.type": "send",
                "messaging.operation.name": "publish",
                "messaging.destination.name": exchange or "amq.default",
                "messaging.rabbitmq.destination.routing_key": routing_key,
                "messaging.message.id": str(row.task_id),
                "celery.task_name": row.task_name,
                "drain.job.id": row.id,
                "drain.job.waited_seconds": (0.0 if row.due_epoch is None
                                             else max(now - row.due_epoch, 0.0)),
            },
        )
        headers: dict[str, str] = {}
        propagate.inject(headers, context=trace.set_span_in_context(span, parent))
        if self._batch is not None:
            self._batch.add_link(span.get_span_context())
        return Traced(headers or None, span)

    @staticmethod
    def sent(traced: Traced, body_size: int) -> None:
        """The message was built and handed to the broker connection."""
        if traced.span is not None:
            traced.span.set_attribute("messaging.message.body.size", body_size)
            traced.span.end()

    @staticmethod
    def failed(traced: Traced, error: BaseException) -> None:
        """The message could not be built (its row goes to dead_jobs)."""
        if traced.span is not None:
            from opentelemetry.trace import Status, StatusCode  # noqa: PLC0415 - optional

            traced.span.record_exception(error)
            traced.span.set_status(Status(StatusCode.ERROR, type(error).__name__))
            traced.span.end()


def _drops_unsampled_parents(tracer: Tracer | None) -> bool:
    """Whether the tracer's provider samples as the SDK's parent-based samplers do by
    default: never a child of a remote parent that was not sampled. Read from the
    sampler's public description (``ParentBased{...,remoteParentNotSampled:
    AlwaysOffSampler,...}``); anything else (no SDK, another sampler): no."""
    if tracer is None:
        return False
    sampler = getattr(tracer, "sampler", None)  # the SDK's Tracer keeps its provider's
    describe = getattr(sampler, "get_description", None)
    text = describe() if callable(describe) else ""
    return isinstance(text, str) and text.startswith("ParentBased{") and (
        "remoteParentNotSampled:AlwaysOffSampler" in text)


#: A wait longer than this (10 years) is no wait but a staged_at or not_before
#: written by hand ('-infinity', a date BC): left out of drain_job_wait_seconds,
#: whose sum it would make +Inf or 6.7e10 for the rest of the process.
MAX_PLAUSIBLE_WAIT = 315_360_000.0


def oldest_due(rows: list[StagedRow]) -> StagedRow | None:
    """The row that waited longest since it became due; None when no row has a
    due time a wait can be measured from (MAX_PLAUSIBLE_WAIT)."""
    floor = time.time() - MAX_PLAUSIBLE_WAIT
    oldest: StagedRow | None = None
    earliest = float("inf")
    for row in rows:
        due = row.due_epoch
        if due is not None and floor <= due < earliest:
            oldest, earliest = row, due
    return oldest
