"""A row of ``staged_jobs`` as the drain reads it: what the store fetches and
the Celery layer (drain.celery.message) turns into a message."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import NamedTuple


class StagedRow(NamedTuple):
    """One row of ``staged_jobs`` as the drain fetches it (JSON kept as text).

    A tuple, not a dataclass: the fetch makes one per row (thousands a second),
    and ``StagedRow._make`` of a fetched tuple costs a fraction of a microsecond,
    where a frozen dataclass's ``__init__`` cost 6 (one ``object.__setattr__``
    per field)."""

    id: int
    #: Its text, as the fetch reads it (Postgres formats it); a UUID where a
    #: caller builds a row by hand. The message's task id is ``str()`` of it.
    task_id: str | uuid.UUID
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
