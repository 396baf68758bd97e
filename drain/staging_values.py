"""A job's values, checked and encoded as the columns of its staged_jobs row.

:func:`row` is the one place :func:`drain.stage`, :func:`drain.stage_many`,
signatures (drain.signatures) and ``drain stage`` turn what they were given
into column values; whatever it refuses raises
:class:`~drain.errors.StagingError` naming the field, before any SQL runs.

Arguments (and a signature's callbacks and chain) are encoded as Celery's
JSON serializer encodes them, by kombu's own encoder
(``kombu.utils.json.dumps``): lists and tuples, dicts with string keys,
strings, numbers, booleans and None as plain JSON, and the types kombu's
encoder registers (datetime, date, time, Decimal, UUID, bytes) as kombu's
``{"__type__": ..., "__value__": ...}`` objects, which the worker's kombu
decodes back into those types, as after ``delay()``. Plain JSON never imports
kombu (about 0.1 s): the standard encoder goes first, kombu's only for what it
cannot encode. Refused, because ``jsonb`` cannot store them: NaN and
infinities, NUL characters (``"\\x00"``, also inside bytes given as text) and
lone surrogates; and values nested deeper than Python's recursion limit.

Times: ``countdown`` / ``eta`` become ``not_before``, ``expires`` becomes
``expires_at``, each an aware datetime that Python (and so the drain) can
hold in UTC; an ``expires`` more than :data:`drain.limits.MAX_EXPIRES`
(3,650 days) ahead is refused, as RabbitMQ refuses such a message.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from drain.errors import StagingError
from drain.limits import MAX_EXPIRES

#: The row's columns, in the INSERT's and COPY's order.
COLUMNS = (
    "task_id", "task_name", "args", "kwargs", "queue", "priority", "tag", "not_before",
    "expires_at",
)
#: With a row that has an embed (a signature's callbacks, a chain): only then, so
#: that staging by name works on a schema from before the column.
EMBED_COLUMNS = (*COLUMNS, "embed")
#: The OpenTelemetry context captured at staging (drain.trace_context), likewise
#: only in the statement of rows that have one.
TRACE_COLUMN = "trace"
# A \u0000 escape in JSON text: preceded by an even number of backslashes, so
# that a string holding a literal backslash followed by "u0000" is not taken
# for a NUL.
_JSON_NUL = re.compile(r"(?<!\\)(?:\\\\)*\\u0000")
_JSON_TYPES = ("lists, dicts, strings, numbers, booleans, None, and datetime, date, time, "
               "Decimal, UUID or bytes (as Celery's JSON serializer sends them)")


@dataclasses.dataclass(frozen=True, slots=True)
class Row:
    """One staged_jobs row's values, checked."""

    task_id: uuid.UUID
    task_name: str
    args: str
    kwargs: str
    #: None: no queue given (NULL): the drain routes it (``--app``) or sends it to celery.
    queue: str | None
    priority: int
    tag: str | None
    not_before: dt.datetime | None
    expires_at: dt.datetime | None
    #: Celery's embed as JSON text (drain.signatures); None: none.
    embed: str | None = None
    #: The staging caller's OpenTelemetry context, its propagators' carrier as
    #: JSON text (drain.trace_context); None: none.
    trace: str | None = None

    def values(self, columns: tuple[str, ...] = COLUMNS) -> tuple[Any, ...]:
        """Column values in ``columns`` order, as COPY takes them."""
        return tuple(getattr(self, column) for column in columns)

    def params(self, suffix: str = "",
               columns: tuple[str, ...] = COLUMNS) -> dict[str, str | None]:
        """Named parameters, every value as text (or None) so that any driver takes them."""
        return {
            f"{column}{suffix}": None if value is None else (
                value.isoformat() if isinstance(value, dt.datetime) else str(value)
            )
            for column, value in zip(columns, self.values(columns), strict=True)
        }


def row(  # noqa: PLR0912 - one check per argument reads best in a row
    task_name: Any,
    args: Any,
    kwargs: Any,
    queue: Any,
    task_id: Any,
    *,
    priority: Any = 0,
    tag: Any = None,
    countdown: Any = None,
    eta: Any = None,
    expires: Any = None,
    embed: Mapping[str, Any] | None = None,
    trace: str | None = None,
) -> Row:
    """The row of one job; StagingError naming the field for anything it cannot hold.

    ``embed`` is Celery's embed (callbacks, errbacks, chain) of a signature
    (drain.signatures), encoded here as the arguments are.
    """
    if not isinstance(task_name, str) or not task_name.strip():
        raise StagingError(f"task name must be a non-empty string, got {task_name!r}")
    if len(text("task name", task_name)) > 1024:
        raise StagingError(f"task name is longer than 1024 bytes: {task_name[:40]!r}...")
    if args is None:
        args = ()
    if isinstance(args, (str, bytes, Mapping)) or not isinstance(args, Sequence):
        raise StagingError(
            f"args for {task_name} must be a list or tuple, got {type(args).__name__}"
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, Mapping):
        raise StagingError(f"kwargs for {task_name} must be a dict, got {type(kwargs).__name__}")
    bad_keys = [k for k in kwargs if not isinstance(k, str)]
    if bad_keys:
        raise StagingError(f"kwargs for {task_name} must have string keys, got {bad_keys[0]!r}")
    if queue is not None and (
        not isinstance(queue, str) or not 1 <= len(text(f"queue for {task_name}", queue)) <= 255
    ):
        raise StagingError(f"queue for {task_name} must be a string of 1 to 255 bytes")
    if task_id is None:
        task_id = uuid.uuid4()
    elif not isinstance(task_id, uuid.UUID):
        try:
            task_id = uuid.UUID(str(task_id))
        except ValueError:
            raise StagingError(f"task_id for {task_name} is not a UUID: {task_id!r}") from None
    if priority is None:
        priority = 0
    if isinstance(priority, bool) or not isinstance(priority, int) or not (
        -32768 <= priority <= 32767
    ):
        raise StagingError(f"priority for {task_name} must be an integer from -32768 to 32767")
    if tag is not None and (
        not isinstance(tag, str) or not 1 <= len(text(f"tag for {task_name}", tag)) <= 255
    ):
        raise StagingError(f"tag for {task_name} must be a string of 1 to 255 bytes")
    if countdown is not None and eta is not None:
        raise StagingError(f"give {task_name} a countdown or an eta, not both")
    now = dt.datetime.now(dt.timezone.utc)
    not_before = None
    if countdown is not None:
        not_before = _later(task_name, "countdown", now, countdown)
    elif eta is not None:
        not_before = _moment(task_name, "eta", eta)
    expires_at = None
    if expires is not None:
        expires_at = (
            _moment(task_name, "expires", expires) if isinstance(expires, dt.datetime)
            else _later(task_name, "expires", now, expires)
        )
        if expires_at - now > MAX_EXPIRES:
            raise StagingError(
                f"expires for {task_name} is more than {MAX_EXPIRES.days:,} days ahead "
                f"({expires_at:%Y-%m-%d}): RabbitMQ refuses a message that expires later "
                "(406 PRECONDITION_FAILED); leave expires out for a job that never expires"
            )
    return Row(
        task_id=task_id,
        task_name=task_name,
        args=encode(task_name, "args", list(args)),
        kwargs=encode(task_name, "kwargs", dict(kwargs)),
        queue=queue,
        priority=priority,
        tag=tag,
        not_before=not_before,
        expires_at=expires_at,
        embed=None if embed is None else encode(task_name, "callbacks or chain", embed),
        trace=trace,
    )


def _later(task_name: str, what: str, now: dt.datetime, value: Any) -> dt.datetime:
    """``now`` plus ``value`` seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise StagingError(f"{what} for {task_name} must be a number of seconds, got {value!r}")
    try:
        return now + dt.timedelta(seconds=value)
    except OverflowError:
        raise StagingError(f"{what} for {task_name} is out of range: {value!r} seconds "
                           "from now is not a date-time Python can hold") from None


def _moment(task_name: str, what: str, value: Any) -> dt.datetime:
    """A datetime as an aware one in UTC; naive means UTC, as in Celery."""
    if not isinstance(value, dt.datetime):
        raise StagingError(f"{what} for {task_name} must be a datetime, got {value!r}")
    if value.tzinfo is None:
        return value.replace(tzinfo=dt.timezone.utc)
    try:
        return value.astimezone(dt.timezone.utc)
    except OverflowError:
        raise StagingError(f"{what} for {task_name} is out of range: {value.isoformat()} "
                           "is not a date-time Python can hold in UTC") from None


def encode(task_name: str, what: str, value: Any) -> str:
    """``value`` as JSON text, as kombu's JSON encoder writes it, that jsonb takes."""
    try:
        encoded = json.dumps(value, allow_nan=False, ensure_ascii=False)
    except TypeError:  # not plain JSON: kombu's types, or nothing JSON carries
        encoded = _kombu_encode(task_name, what, value)
    except ValueError as exc:
        raise _not_json(task_name, what, exc) from None
    except RecursionError:
        raise _too_deep(task_name, what) from None
    return checked_json(task_name, what, encoded)


def _kombu_encode(task_name: str, what: str, value: Any) -> str:
    # kombu takes ~0.1 s to import: only values plain JSON cannot encode pay it.
    from kombu.utils.json import dumps  # noqa: PLC0415

    try:
        encoded: str = dumps(value, allow_nan=False, ensure_ascii=False)  # type: ignore[no-untyped-call]
    except (TypeError, ValueError) as exc:
        raise _not_json(task_name, what, exc) from None
    except RecursionError:
        raise _too_deep(task_name, what) from None
    return encoded


def _not_json(task_name: str, what: str, exc: Exception) -> StagingError:
    hint = ("jsonb stores no NaN or infinity" if isinstance(exc, ValueError)
            and "Out of range float" in str(exc) else f"stage {_JSON_TYPES}")
    return StagingError(f"{what} for {task_name} are not JSON-serialisable: {exc}; {hint}")


def _too_deep(task_name: str, what: str) -> StagingError:
    return StagingError(f"{what} for {task_name} are nested too deeply to encode as JSON "
                        "(deeper than Python's recursion limit)")


def checked_json(task_name: str, what: str, encoded: str) -> str:
    """JSON text as jsonb will take it: no NUL, valid Unicode."""
    if _JSON_NUL.search(encoded):
        raise StagingError(f"{what} for {task_name} contain a NUL character, which jsonb refuses")
    text(f"{what} for {task_name}", encoded)
    return encoded


def text(what: str, value: str) -> bytes:
    """``value`` as UTF-8; refuses what Postgres text cannot hold (NUL, lone surrogates)."""
    if "\x00" in value:
        raise StagingError(f"{what} contains a NUL character, which Postgres refuses")
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StagingError(f"{what} is not valid Unicode text: {exc.reason}") from None
