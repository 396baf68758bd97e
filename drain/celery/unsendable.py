"""Rows the broker could never accept, found before anything is routed or published.

A row staged by plain SQL can hold what staging refuses (drain.staging): an
``expires_at`` Python cannot read (``infinity``, a year past 9999: see
drain.postgres.timestamps) or one more than 3,650 days ahead, which RabbitMQ refuses
by closing the channel (drain.limits). Publishing it would cost a probe of the
whole batch (drain.broker.refusal) for a verdict known in advance, so
:func:`screen` moves such rows to dead_jobs with reason ``invalid`` and the
cause, the path every row that cannot become a message takes; the rest of the
batch is published as usual.
"""

from __future__ import annotations

import datetime as dt

from drain.limits import MAX_EXPIRATION_MS, MAX_EXPIRES
from drain.postgres import timestamps
from drain.postgres.rows import StagedRow


def problem(row: StagedRow, now: float) -> str | None:
    """Why ``row`` can never be published (the dead_jobs detail), or None."""
    expires = row.expires_at
    if expires is None:
        return None
    text = timestamps.unreadable(expires)
    if text is not None:
        return (f"expires_at {text!r} cannot be read (Python's datetime holds years 1 to "
                f"9999) nor sent: RabbitMQ refuses a message expiration above "
                f"{MAX_EXPIRATION_MS} ms ({MAX_EXPIRES.days} days)")
    if expires.timestamp() - now > MAX_EXPIRES.total_seconds():
        return (f"expires_at {expires.astimezone(dt.timezone.utc).isoformat()} is more than "
                f"{MAX_EXPIRES.days} days ahead: RabbitMQ refuses a message expiration above "
                f"{MAX_EXPIRATION_MS} ms")
    return None


def screen(rows: list[StagedRow], doomed: list[tuple[int, str, str]],
           now: float) -> list[StagedRow]:
    """The rows that can be sent; the others go to ``doomed`` as 'invalid'."""
    kept: list[StagedRow] = []
    for row in rows:
        why = problem(row, now)
        if why is None:
            kept.append(row)
        else:
            doomed.append((row.id, "invalid", why))
    return kept
