"""What a backfill keeps in Postgres besides its jobs: the ledger and the attempts.

* ``drain_backfill_ledger``: one row per committed partition, written in the
  partition's own transaction (:mod:`drain.spark.writer`). The driver reads it
  before a run: the partition count an id was started with, and which
  partitions are committed already (a re-run skips them before any shuffle).
* ``drain_backfills``: one row per backfill id, claimed by the first driver
  before any partition is (``INSERT ... ON CONFLICT DO NOTHING``): what the
  partitioning depends on (:class:`Partitioning`). Every later run compares
  itself with it (:func:`prepare`): a second driver adopts its partition count
  (or is refused, when ``--partitions`` says another), and a resume whose
  records would land in other partitions is refused (PartitioningChanged).
* ``drain_backfill_attempts``: one row per Spark attempt at a partition,
  written outside that transaction, so that an attempt which staged nothing
  is on record too: a task Spark retried after a failure, a speculative copy,
  an attempt that found its partition committed. ``outcome`` is NULL for an
  attempt stopped or lost before it could write how it ended (Spark killed the
  slower copy, or its executor died). An attempt is identified by Spark's
  ``taskAttemptId()`` (``task_attempt_id``): ``attempt``, Spark's
  ``attemptNumber()``, reads 0 again for a retry in a new attempt of the
  stage (:mod:`drain.spark.task`). The driver reads them after the write and
  the run reports them (:class:`Attempts`).

Both tables come from ``drain migrate`` (staging_schema.sql).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import psycopg

from drain.errors import ConfigError, DatabaseUnavailable, PartitioningChanged, SchemaMissing
from drain.settings.url_parts import first_line
from drain.settings.urls import mask_database_url
from drain.spark import task

LEDGER = "drain_backfill_ledger"
BACKFILLS = "drain_backfills"

#: How a record's partition is computed: 2 = ``pmod(murmur3(cast(key as string)), n)``
#: (:func:`drain.spark.mapping.partition_of`). 1 was murmur3 of the key in its Spark
#: type (int and bigint hash differently); ledgers of version 1 were not recorded in
#: drain_backfills.
HASH_VERSION = 2
_INTEGRAL = ("tinyint", "smallint", "int", "bigint")
ATTEMPTS = "drain_backfill_attempts"

COMMITTED = "committed"
FOUND_COMMITTED = "found committed"
FAILED = "failed"

_STARTED = (
    "INSERT INTO drain_backfill_attempts (backfill_id, run_token, partition, attempt, "
    "task_attempt_id, host) VALUES (%s, %s, %s, %s, %s, %s) RETURNING id"
)
_RECORDED = (
    "SELECT partitions, key_expr, key_type, hash_version FROM drain_backfills "
    "WHERE backfill_id = %s"
)
_RECORDED_LOCKED = _RECORDED + " FOR SHARE"
#: Columns added to the tables above since they were created (``drain migrate`` adds them).
_ADDED_COLUMNS = ((ATTEMPTS, "task_attempt_id"), ("staged_jobs", "trace"))
_ENDED = "UPDATE drain_backfill_attempts SET outcome = %s, ended_at = now() WHERE id = %s"


@dataclasses.dataclass(frozen=True)
class LedgerState:
    """The ledger's record of one backfill id."""

    partitions: int | None
    rows: int
    #: The committed partitions' indexes.
    indexes: frozenset[int] = frozenset()

    @property
    def committed(self) -> int:
        """How many partitions are committed."""
        return len(self.indexes)


@dataclasses.dataclass(frozen=True)
class Partitioning:
    """What a backfill id's partitioning depends on (its drain_backfills row)."""

    partitions: int
    #: The mapping's key expression (``--key``).
    key: str
    #: The key's Spark type (``int``, ``bigint``, ``string``, ``decimal(10,2)``...).
    key_type: str
    hash_version: int = HASH_VERSION

    @property
    def identity(self) -> str:
        """The key's canonical type: two runs whose identities are equal give a record
        the same text (its task id) and so the same partition. ``integer`` for every
        integral type and decimal(p,0) (their text is the digits); any other type is
        its own (a string, a date, a decimal with a scale, a double...)."""
        return key_identity(self.key_type)


def key_identity(key_type: str) -> str:
    """:attr:`Partitioning.identity` of a Spark type's simpleString."""
    if key_type in _INTEGRAL or (key_type.startswith("decimal(") and key_type.endswith(",0)")):
        return "integer"
    return key_type


@dataclasses.dataclass(frozen=True)
class Attempts:
    """How the Spark attempts of one run went (from drain_backfill_attempts).

    ``extra`` attempts are those beyond one per partition: Spark retried a
    failed task or ran a speculative copy. Each partition still commits at
    most once (the ledger's primary key); ``committed_twice`` lists any
    partition this run's attempts committed more than once, which must never
    happen.
    """

    total: int = 0
    extra: int = 0
    #: Partitions that had more than one attempt.
    partitions_retried: int = 0
    #: Attempts that ended in an error (their transaction rolled back).
    failed: int = 0
    #: Attempts that found their partition committed and staged nothing.
    found_committed: int = 0
    #: Attempts stopped or lost before they could record how they ended.
    unheard: int = 0
    committed_twice: tuple[int, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "committed_twice": list(self.committed_twice)}

    def text(self) -> str:
        """``2 partitions took 3 more attempts ...`` (empty when there were none)."""
        if not self.extra:
            return ""
        how = [f"{n} {what}" for n, what in (
            (self.failed, "failed"), (self.found_committed, "found it committed"),
            (self.unheard, "stopped by Spark or lost"),
        ) if n]
        return (f"{self.partitions_retried} partition(s) took {self.extra} more Spark "
                f"attempt(s) (retries or speculative copies); only one attempt of each "
                f"committed ({', '.join(how)})")


# -- on the driver -------------------------------------------------------------------


def connect(database_url: str, purpose: str) -> psycopg.Connection[tuple[Any, ...]]:
    try:
        return psycopg.connect(database_url, connect_timeout=10, autocommit=True,
                               application_name=purpose[:63])
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"database {mask_database_url(database_url)} unreachable: {first_line(exc)}"
        ) from None


def prepare(database_url: str, run_id: str, wanted: Partitioning, *,
            explicit: bool = True) -> tuple[Partitioning, LedgerState]:
    """Check the schema (from `drain migrate`), then claim ``run_id``'s partitioning, or
    compare ``wanted`` with the one its first run claimed; what to run with.

    A different partition count is adopted (``explicit``: refused, ConfigError); a
    different key, key identity or hash version is refused (PartitioningChanged).
    """
    with connect(database_url, "drain spark") as conn:
        _check_schema(conn, database_url)
        state = ledger_state(conn, run_id)
        recorded = _recorded(conn, run_id)
        if recorded is None and state.indexes:
            # Committed by a drain that did not record its partitioning (hash version 1).
            if state.partitions is not None and state.committed >= state.partitions:
                return dataclasses.replace(wanted, partitions=state.partitions,
                                           hash_version=1), state
            raise unrecorded(run_id, state)
        if recorded is None:
            conn.execute(
                "INSERT INTO drain_backfills (backfill_id, partitions, hash_version, key_expr, "
                "key_type, key_identity) VALUES (%s, %s, %s, %s, %s, %s) "
                "ON CONFLICT (backfill_id) DO NOTHING",
                (run_id, wanted.partitions, wanted.hash_version, wanted.key, wanted.key_type,
                 wanted.identity),
            )
            recorded = _recorded(conn, run_id)
            assert recorded is not None
            state = ledger_state(conn, run_id)
    check_resume(run_id, recorded, wanted, explicit, state)
    return dataclasses.replace(wanted, partitions=recorded.partitions), state


def unrecorded(run_id: str, state: LedgerState) -> PartitioningChanged:
    """The refusal of a resume of an id whose partitioning was not recorded."""
    return PartitioningChanged(
        f"backfill id {run_id!r} was started by an older drain that did not record "
        f"its partitioning ({state.committed} of {state.partitions} partitions "
        "committed, hash version 1): finish it with that drain version, or use a "
        "new --id (records staged under both ids get different task ids)"
    )


def check_resume(run_id: str, recorded: Partitioning, wanted: Partitioning, explicit: bool,
                 state: LedgerState) -> None:
    """Refuse ``wanted`` where it differs from the id's ``recorded`` partitioning (see
    :func:`prepare`). A complete id stages nothing whatever its key is now: only an
    explicit count is compared then."""
    if state.partitions is not None and state.committed >= state.partitions:
        wanted = dataclasses.replace(recorded, partitions=wanted.partitions)
    if recorded.partitions != wanted.partitions and explicit:
        raise ConfigError(
            f"backfill id {run_id!r} was started with {recorded.partitions} partitions "
            f"({state.committed} committed): re-run it with --partitions "
            f"{recorded.partitions} (rows are assigned to partitions by their key modulo "
            "the count), or use a new id"
        )
    what = ""
    if recorded.hash_version != wanted.hash_version:
        what = (f"with partition hash version {recorded.hash_version}, this drain has "
                f"{wanted.hash_version}")
    elif recorded.key != wanted.key:
        what = f"with key {recorded.key!r}, this run's is {wanted.key!r}"
    elif recorded.identity != wanted.identity:
        what = (f"with a key of type {recorded.key_type}, it is {wanted.key_type} now "
                "(only a change between integral types keeps a key's text)")
    if what:
        raise PartitioningChanged(
            f"backfill id {run_id!r} was started {what}: its records would get other "
            f"partitions or task ids ({state.committed} partitions committed), so nothing "
            "was staged; restore the key, or use a new --id"
        )


def _recorded(conn: psycopg.Connection[tuple[Any, ...]], run_id: str, *,
              lock: bool = False) -> Partitioning | None:
    row = conn.execute(_RECORDED_LOCKED if lock else _RECORDED, (run_id,)).fetchone()
    return None if row is None else Partitioning(int(row[0]), row[1], row[2], int(row[3]))


def _check_schema(conn: psycopg.Connection[tuple[Any, ...]], database_url: str) -> None:
    missing = [
        name for name in ("staged_jobs", LEDGER, ATTEMPTS, BACKFILLS)
        if not _exists(conn, name)
    ]
    if "staged_jobs" in missing:
        raise SchemaMissing(
            f"database {mask_database_url(database_url)} has no staged_jobs table: "
            "run `drain migrate` first"
        )
    if missing:
        raise SchemaMissing(
            f"database {mask_database_url(database_url)} has an older drain schema "
            f"(no {missing[0]} table): run `drain migrate`"
        )
    for table, column in _ADDED_COLUMNS:
        if not _has_column(conn, table, column):
            raise SchemaMissing(
                f"database {mask_database_url(database_url)} has an older drain schema "
                f"(no column {table}.{column}): run `drain migrate`"
            )


def recorded_state(database_url: str, run_id: str) -> tuple[Partitioning | None, LedgerState]:
    """What the ledger holds for ``run_id`` without claiming anything (a dry run); an
    empty state when the schema has no ledger yet."""
    with connect(database_url, "drain spark") as conn:
        if not all(_exists(conn, name) for name in (LEDGER, BACKFILLS)):
            return None, LedgerState(None, 0)
        return _recorded(conn, run_id), ledger_state(conn, run_id)


def _exists(conn: psycopg.Connection[tuple[Any, ...]], table: str) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table,)).fetchone()
    return bool(row and row[0])


def _has_column(conn: psycopg.Connection[tuple[Any, ...]], table: str, column: str) -> bool:
    row = conn.execute(
        "SELECT EXISTS (SELECT FROM pg_attribute WHERE attrelid = to_regclass(%s) "
        "AND attname = %s AND NOT attisdropped)", (table, column),
    ).fetchone()
    return bool(row and row[0])


def earlier_partitions(database_url: str, run_id: str) -> int | None:
    """The partition count an earlier run of ``run_id`` used (None: no earlier run)."""
    recorded, state = recorded_state(database_url, run_id)
    return recorded.partitions if recorded is not None else state.partitions


def ledger_state(conn: psycopg.Connection[tuple[Any, ...]], run_id: str) -> LedgerState:
    rows = conn.execute(
        "SELECT partition, partitions, rows FROM drain_backfill_ledger WHERE backfill_id = %s",
        (run_id,),
    ).fetchall()
    return LedgerState(
        partitions=max((int(r[1]) for r in rows), default=None),
        rows=sum(int(r[2]) for r in rows),
        indexes=frozenset(int(r[0]) for r in rows),
    )


def attempts(database_url: str, run_token: str) -> Attempts:
    """How this run's attempts went (``run_token``: :attr:`WriterConfig.run_token`)."""
    with connect(database_url, "drain spark") as conn:
        rows = conn.execute(
            "SELECT partition, outcome FROM drain_backfill_attempts WHERE run_token = %s",
            (run_token,),
        ).fetchall()
    per_partition: dict[int, int] = {}
    commits: dict[int, int] = {}
    outcomes: dict[str | None, int] = {}
    for partition, outcome in rows:
        per_partition[partition] = per_partition.get(partition, 0) + 1
        kind = outcome.split(":", 1)[0] if outcome else None
        outcomes[kind] = outcomes.get(kind, 0) + 1
        if outcome == COMMITTED:
            commits[partition] = commits.get(partition, 0) + 1
    return Attempts(
        total=len(rows),
        extra=len(rows) - len(per_partition),
        partitions_retried=sum(1 for n in per_partition.values() if n > 1),
        failed=outcomes.get(FAILED, 0),
        found_committed=outcomes.get(FOUND_COMMITTED, 0),
        unheard=outcomes.get(None, 0),
        committed_twice=tuple(sorted(p for p, n in commits.items() if n > 1)),
    )


# -- on the executors ----------------------------------------------------------------


def attempt_started(conn: psycopg.Connection[tuple[Any, ...]], *, run_id: str,
                    run_token: str, partition: int, attempt: task.Attempt,
                    host: str | None) -> int:
    """Record an attempt (autocommit, before the partition's transaction); its id."""
    row = conn.execute(_STARTED, (run_id, run_token, partition, attempt.number,
                                  attempt.task_attempt_id, host)).fetchone()
    assert row is not None
    return int(row[0])


def check_claim(conn: psycopg.Connection[tuple[Any, ...]], run_id: str, partition: int,
                partitions: int, writes: Partitioning | None) -> None:
    """In a partition's transaction, before its claim: refuse (PartitioningChanged) to
    write it unless drain_backfills still records the partitioning the run writes
    with (``partitions``; and ``writes``' hash version, key and key identity), and
    hold that row (FOR SHARE) until the partition commits.

    drain's own drivers cannot get here with another partitioning: :func:`prepare`
    claims the row or compares with it before any partition is written, and drain
    never updates or deletes it. What can is outside drain's flow: the row deleted
    or changed by hand while a run writes (then claimed again by another driver with
    another count), or :func:`drain.spark.writer.write` called without
    :func:`prepare`. Checked here, every committed partition agrees with the row.
    """
    recorded = _recorded(conn, run_id, lock=True)
    if recorded is None:
        what = "has no drain_backfills row (deleted while this run was writing?)"
    elif recorded.partitions != partitions:
        what = (f"is recorded in drain_backfills with {recorded.partitions} partitions, this "
                f"run writes {partitions}")
    elif writes is not None and (recorded.hash_version, recorded.key, recorded.identity) != (
            writes.hash_version, writes.key, writes.identity):
        what = (f"is recorded in drain_backfills with key {recorded.key!r} "
                f"({recorded.key_type}, hash version {recorded.hash_version}), this run "
                f"writes key {writes.key!r} ({writes.key_type}, hash version "
                f"{writes.hash_version})")
    else:
        return
    raise PartitioningChanged(
        f"partition {partition}: backfill id {run_id!r} {what}: its records would get other "
        "partitions; nothing of it was staged"
    )


def attempt_ended(conn: psycopg.Connection[tuple[Any, ...]], attempt_id: int,
                  outcome: str) -> None:
    """Record how an attempt ended: :data:`COMMITTED`, :data:`FOUND_COMMITTED`, or
    ``failed: <why>``."""
    conn.execute(_ENDED, (outcome[:500], attempt_id))
