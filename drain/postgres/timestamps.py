"""Timestamps Python cannot hold, read without failing the batch.

Postgres' timestamptz holds ``infinity``, ``-infinity``, years past 9999 and
BC dates; Python's ``datetime`` holds years 1 to 9999 only, and psycopg's
loader raises ``DataError`` for the rest ("timestamp too large (after year
10K)"). Raised in a fetch, that error would fail the whole batch, every cycle:
one row staged by plain SQL with ``expires_at => 'infinity'`` stopped the drain.

:func:`register` installs, on a connection, a subclass of psycopg's own
timestamptz loaders (psycopg's documentation shows the technique, "Example:
handling infinity date") that returns an :class:`Unreadable` instead of
raising. An Unreadable is a ``datetime`` (the latest or earliest one Python
has, so code that only compares or prints it keeps working) that remembers the
text Postgres sent; the pipeline moves a row whose timestamp is one to
dead_jobs (reason ``invalid``), and ``drain dead list --json`` shows the text.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
from psycopg.abc import Buffer
from psycopg.types.datetime import TimestamptzBinaryLoader, TimestamptzLoader

_UTC = dt.timezone.utc


class Unreadable(dt.datetime):
    """A timestamptz Python's datetime cannot hold: the nearest one it can, and
    what Postgres sent (``text``: 'infinity', '10000-01-01 00:00:00+00', ...)."""

    text: str

    def __new__(cls, text: str) -> Unreadable:
        low = text.startswith("-") or text.endswith(" BC")
        bound = dt.datetime.min if low else dt.datetime.max
        value = super().__new__(cls, bound.year, bound.month, bound.day, bound.hour,
                                bound.minute, bound.second, bound.microsecond, tzinfo=_UTC)
        value.text = text
        return value

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Unreadable({self.text!r})"


def _text(data: Buffer) -> str:
    return bytes(data).decode("utf-8", "replace")


class _TextLoader(TimestamptzLoader):
    def load(self, data: Buffer) -> dt.datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            return Unreadable(_text(data))


class _BinaryLoader(TimestamptzBinaryLoader):
    def load(self, data: Buffer) -> dt.datetime:
        try:
            return super().load(data)
        except psycopg.DataError:
            # Microseconds since 2000-01-01 UTC; the extremes are the infinities.
            micros = int.from_bytes(bytes(data), "big", signed=True)
            text = ("infinity" if micros == 2**63 - 1 else "-infinity" if micros == -(2**63)
                    else f"{'-' if micros < 0 else ''}{abs(micros)} us from 2000-01-01")
            return Unreadable(text)


def register(conn: psycopg.Connection[Any]) -> None:
    """Load this connection's timestamptz values without raising (see the module)."""
    conn.adapters.register_loader("timestamptz", _TextLoader)
    conn.adapters.register_loader("timestamptz", _BinaryLoader)


def unreadable(value: object) -> str | None:
    """The text Postgres sent for ``value`` if Python could not hold it, else None."""
    return value.text if isinstance(value, Unreadable) else None
