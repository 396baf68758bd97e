"""A row of ``staged_jobs`` as the drain reads it: what the store fetches and
the Celery layer (drain.celery.message) turns into a message."""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid


@dataclasses.dataclass(frozen=True, slots=True)
class StagedRow:
    """One row of ``staged_jobs`` as the drain fetches it (JSON kept as text)."""

    id: int
    task_id: uuid.UUID
    task_name: str
    args_json: str
    kwargs_json: str
    queue: str
    priority: int = 0
    tag: str | None = None
    expires_at: dt.datetime | None = None
    #: Not delayed (``not_before IS NULL``): read through the priority marks.
    ready: bool = True
    #: Staged without a queue (``queue`` NULL, or 'celery' with ``queue_legacy``;
    #: ``queue`` then reads 'celery', Celery's default): ``drain run --app``
    #: routes it as the app's ``apply_async`` would.
    unrouted: bool = False
    #: Celery's embed (callbacks, errbacks, chain) as JSON text; None: none.
    embed_json: str | None = None
    #: The staging caller's OpenTelemetry context (``staged_jobs.trace``, the
    #: propagators' carrier as JSON text); None: none (drain.daemon.tracing).
    trace_json: str | None = None
    #: When it was staged (the staging transaction's start), as a Unix time; read
    #: only for a row with a ``trace`` (None otherwise).
    staged_epoch: float | None = None
    #: When it became due, as a Unix time: when it was staged, or its
    #: ``not_before`` if later. How long it waited is measured from here.
    due_epoch: float | None = None
    #: The transaction that staged or last updated the row (``staged_jobs.xact``):
    #: the drain removes the row only as it read it (drain.postgres.conflicts).
    xact: int = 0
