"""What a test's code staged: the rows of ``staged_jobs``, read on the test's connection.

:class:`StagedJobs` (the ``staged_jobs`` fixture of drain.pytest_plugin) reads
the real table through the connection the test gives it, so it sees what that
connection sees: the jobs staged on it in a transaction still open (a Django
``TestCase`` wraps each test in one) and those other connections committed.
Each row is a :class:`StagedJob`, its arguments decoded as the worker's kombu
decodes them (a datetime, Decimal or UUID comes back as one).

Expected arguments are compared as the worker would get them: encoded as
:func:`drain.stage` encodes them and decoded again, so a tuple equals the list
the worker receives, and ``unittest.mock.ANY`` (which cannot be encoded) is
compared as it is, anywhere in them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import decimal
import uuid
from collections.abc import Iterator
from typing import Any

from drain import consumer_sql, staging_values
from drain.celery import encoding
from drain.errors import FixtureError, StagingError
from drain.postgres import sql

#: The options :meth:`StagedJobs.assert_staged` and :meth:`StagedJobs.find` compare,
#: named as :func:`drain.stage` takes them (``eta`` is also where ``countdown`` lands).
OPTIONS = ("queue", "priority", "tag", "task_id", "eta", "expires")
#: At most this many staged jobs are listed in a failed assertion's message.
SHOWN = 20
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
_UNDEFINED_TABLE = "42P01"


@dataclasses.dataclass(frozen=True)
class StagedJob:
    """One row of ``staged_jobs``, as the worker would get its job."""

    id: int
    task_id: uuid.UUID
    task_name: str
    args: list[Any]
    kwargs: dict[str, Any]
    #: None: staged without a queue (``drain run --app`` routes it, else 'celery').
    queue: str | None
    priority: int
    tag: str | None
    #: Not published before then (from ``countdown`` or ``eta``); None: at once.
    eta: dt.datetime | None
    #: Not published at or after then (``expires``); None: never expires.
    expires: dt.datetime | None
    staged_at: dt.datetime
    #: Celery's embed of a signature with callbacks or of a chain (drain.signatures):
    #: ``{"callbacks": [...], "errbacks": [...], "chain": [...], "chord": None}``.
    embed: dict[str, Any] | None
    #: The staging transaction's id: the drain's order within a priority.
    xact: int
    #: Whether a drain would publish it now: no delay, or its time has come.
    due: bool
    #: Past its ``expires``: a drain moves it to dead_jobs instead of publishing it.
    expired: bool

    @classmethod
    def of_row(cls, row: tuple[Any, ...]) -> StagedJob:
        """From a ``testing_staged`` row (drain/queries.sql)."""
        (row_id, task_id, task_name, args, kwargs, queue, priority, tag, not_before,
         expires_at, staged_at, embed, xact, due, expired) = row
        return cls(
            id=int(row_id), task_id=uuid.UUID(task_id), task_name=task_name,
            args=encoding.decode(args), kwargs=encoding.decode(kwargs), queue=queue,
            priority=int(priority), tag=tag, eta=_moment(not_before),
            expires=_moment(expires_at), staged_at=_moment(staged_at) or _EPOCH,
            embed=None if embed is None else encoding.decode(embed), xact=int(xact),
            due=bool(due), expired=bool(expired),
        )

    def describe(self, also: tuple[str, ...] = ()) -> str:
        """``task(args=..., kwargs=..., <options set>)``; ``also``: options shown anyway."""
        parts = [f"args={self.args!r}", f"kwargs={self.kwargs!r}"]
        for name in OPTIONS:
            value = getattr(self, name)
            if name in also or (name != "task_id" and value is not None and value != 0):
                parts.append(f"{name}={_shown(value)}")
        return f"{self.task_name}({', '.join(parts)})"


def _moment(epoch: str | None) -> dt.datetime | None:
    """An exact epoch (text) as an aware UTC datetime; beyond what Python holds
    (infinity, BC, year 10000: only a plain INSERT stages those), its bound."""
    if epoch is None:
        return None
    seconds = decimal.Decimal(epoch)
    with contextlib.suppress(OverflowError):
        if seconds.is_finite():
            return _EPOCH + dt.timedelta(microseconds=int(seconds * 1_000_000))
    bound = dt.datetime.max if seconds > 0 else dt.datetime.min
    return bound.replace(tzinfo=dt.timezone.utc)


def _shown(value: Any) -> str:
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return repr(str(value) if isinstance(value, uuid.UUID) else value)


def read(conn: Any) -> list[StagedJob]:
    """Every staged row ``conn`` sees, in staging order."""
    try:
        rows = consumer_sql.rows(conn, sql.query("testing_staged"), {})
    except Exception as exc:
        if _sqlstate(exc) == _UNDEFINED_TABLE:
            raise FixtureError(
                "the test database has no staged_jobs table: apply drain's schema to it "
                "(`drain migrate --database-url ...`, or drain.store.migrate(conn) in a "
                "session fixture, or a migration of your own running it)") from exc
        raise
    return [StagedJob.of_row(row) for row in rows]


def _sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error, also wrapped by Django or SQLAlchemy."""
    seen: BaseException | None = exc
    while seen is not None:
        for attr in ("sqlstate", "pgcode"):  # psycopg 3, psycopg2
            code = getattr(seen, attr, None)
            if isinstance(code, str):
                return code
        orig = getattr(seen, "orig", None)  # SQLAlchemy's DBAPIError
        seen = orig if isinstance(orig, BaseException) else seen.__cause__
    return None


def delete(conn: Any, ids: list[int]) -> None:
    """Delete these rows on ``conn`` (in its transaction, if one is open)."""
    if ids:
        consumer_sql.execute(conn, sql.query("testing_delete"), {"ids": ids})


class StagedJobs:
    """The staged jobs a test's connection sees (the ``staged_jobs`` fixture).

    Every method reads the table anew. :meth:`capture` gives a view of only the
    jobs staged inside a ``with`` block.
    """

    def __init__(self, connection: Any, *, before: frozenset[int] = frozenset()) -> None:
        #: The connection the rows are read (and deleted) on.
        self.connection = connection
        self._before = before
        self._after: frozenset[int] | None = None

    def all(self) -> list[StagedJob]:
        """Every staged job, in staging order (of a capture: those staged in its block)."""
        return [job for job in read(self.connection) if self._mine(job)]

    def __iter__(self) -> Iterator[StagedJob]:
        return iter(self.all())

    def __len__(self) -> int:
        return len(self.all())

    def _mine(self, job: StagedJob) -> bool:
        return job.id not in self._before and (self._after is None or job.id in self._after)

    def find(self, task: Any = None, args: Any = None, kwargs: Any = None,
             **options: Any) -> list[StagedJob]:
        """The staged jobs of ``task`` (a name or a Celery task; None: any) whose
        args, kwargs and ``options`` (:data:`OPTIONS`) equal those given; what is
        not given is not compared."""
        want = _Expected.of(task, args, kwargs, options)
        return [job for job in self.all() if want.matches(job)]

    def assert_staged(self, task: Any, args: Any = None, kwargs: Any = None,
                      **options: Any) -> StagedJob:
        """Fail, listing what was staged instead, unless a job like this is staged
        (as :meth:`find` compares); the first one that is."""
        __tracebackhide__ = True  # pytest shows the test's line, not this one
        want = _Expected.of(task, args, kwargs, options)
        jobs = self.all()
        for job in jobs:
            if want.matches(job):
                return job
        raise AssertionError(f"no staged job matches {want.describe()}\n"
                             + _listing(jobs, "staged instead", want.shown))

    def assert_nothing_staged(self) -> None:
        """Fail, listing them, if any job is staged."""
        __tracebackhide__ = True
        jobs = self.all()
        if jobs:
            raise AssertionError("expected no staged job\n" + _listing(jobs, "staged"))

    def clear(self) -> int:
        """Delete the staged jobs (of a capture: those staged in its block), on the
        test's connection; how many."""
        ids = [job.id for job in self.all()]
        delete(self.connection, ids)
        return len(ids)

    @contextlib.contextmanager
    def capture(self) -> Iterator[StagedJobs]:
        """``with staged_jobs.capture() as staged:`` the jobs staged inside the block
        only (those still staged when it is read)."""
        view = StagedJobs(self.connection,
                          before=frozenset(job.id for job in read(self.connection)))
        yield view
        view._after = frozenset(job.id for job in read(self.connection) if view._mine(job))


def _listing(jobs: list[StagedJob], what: str, also: tuple[str, ...] = ()) -> str:
    if not jobs:
        return "nothing is staged"
    lines = [f"{what} ({len(jobs)} job{'s' if len(jobs) != 1 else ''}):"]
    lines += [f"  {job.describe(also)}" for job in jobs[:SHOWN]]
    if len(jobs) > SHOWN:
        lines.append(f"  ... and {len(jobs) - SHOWN} more")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Expected:
    """What a test looks for, normalised as the staged values are."""

    task_name: str | None
    values: dict[str, Any]

    @classmethod
    def of(cls, task: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> _Expected:
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}: compare "
                            f"{', '.join(OPTIONS)} (or read StagedJob fields from find())")
        name = task if task is None or isinstance(task, str) else getattr(task, "name", None)
        if task is not None and not isinstance(name, str):
            raise TypeError(f"task must be a task name or a Celery task, got {task!r}")
        values = {key: value for key, value in (("args", args), ("kwargs", kwargs))
                  if value is not None}
        values = {key: _as_staged(name or "task", key, value) for key, value in values.items()}
        for key, value in options.items():
            values[key] = _option(key, value)
        return cls(name, values)

    @property
    def shown(self) -> tuple[str, ...]:
        return tuple(self.values)

    def matches(self, job: StagedJob) -> bool:
        if self.task_name is not None and job.task_name != self.task_name:
            return False
        return all(value == getattr(job, key) for key, value in self.values.items())

    def describe(self) -> str:
        parts = [f"{key}={_shown(value)}" for key, value in self.values.items()]
        return f"{self.task_name or '<any task>'}({', '.join(parts)})"


def _as_staged(task_name: str, what: str, value: Any) -> Any:
    """``value`` as the worker would get it once staged; as it is if it cannot be
    staged (``mock.ANY`` inside it, say)."""
    if isinstance(value, tuple):
        value = list(value)
    try:
        return encoding.decode(staging_values.encode(task_name, what, value))
    except StagingError:
        return value


def _option(name: str, value: Any) -> Any:
    if name == "task_id" and isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            return value
    if name in ("eta", "expires") and isinstance(value, dt.datetime) and value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)  # naive means UTC, as in drain.stage
    return value
