"""The idempotent per-partition writer: COPY into staged_jobs and a ledger row, in one
transaction.

The jobs are hash-partitioned on their key's text into a fixed number of
partitions (partition ``pmod(murmur3(cast(key as string)), n)``:
:func:`drain.spark.mapping.partition_of`), so a given record always lands in
the same partition: on a Spark task retry (the same partition index over the
same shuffle output) and on a re-run, even if its key went from int to bigint.
Every row carries its partition (``_bucket``, the same hash) and the writer
checks it: if the partitioning ever differed, the partition fails instead.

Each partition, on an executor, records its attempt in
``drain_backfill_attempts`` (:mod:`drain.spark.ledger`; outside the
transaction, with how it ended once it has), then, in one transaction:

0. Check the id's ``drain_backfills`` row still records the partitioning the
   rows were split by, and hold it (``FOR SHARE``) until the commit
   (:func:`drain.spark.ledger.check_claim`).
1. ``INSERT INTO drain_backfill_ledger (backfill_id, partition, ...) ON
   CONFLICT DO NOTHING RETURNING``: no row back means the partition has been
   committed already (by an earlier attempt or an earlier run) -> stage
   nothing. A concurrent attempt of the same partition waits here on the
   primary key until the first one commits or rolls back.
2. ``COPY staged_jobs (...) FROM STDIN (FORMAT csv)``: the partition's jobs.
3. Check that the partition got all its records from a live executor, then
   record the row count and ``committed_at`` (``clock_timestamp()`` in the
   transaction's last statement, not ``now()``, its start); COMMIT. The jobs
   and the ledger row commit together or not at all, so a failure anywhere
   before the commit leaves nothing.

A partition the ledger showed committed when the run started gets no input
(its records are filtered out before the shuffle) and returns without a
connection: a resume costs what its missing partitions cost.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import itertools
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Literal

import psycopg

from drain.errors import DrainError, StagingError
from drain.settings.url_parts import first_line
from drain.spark import ledger, task
from drain.spark.mapping import COPY_COLUMNS, partition_of

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

_CHUNK_ROWS = 8192
_RESULT_SCHEMA = "partition int, rows long, skipped boolean, retried_after_commit boolean"
_COPY = f"COPY staged_jobs ({', '.join(COPY_COLUMNS)}) FROM STDIN (FORMAT csv)"
_CLAIM = (
    "INSERT INTO drain_backfill_ledger (backfill_id, partition, partitions, run_token) "
    "VALUES (%s, %s, %s, %s) ON CONFLICT (backfill_id, partition) DO NOTHING RETURNING 1"
)
_EARLIER = (
    "SELECT rows, run_token::text FROM drain_backfill_ledger "
    "WHERE backfill_id = %s AND partition = %s"
)
#: The transaction's last statement: ``now()`` would be the transaction's start, before
#: the COPY; ``clock_timestamp()`` is as close to the COMMIT as a statement gets.
_COUNT = (
    "UPDATE drain_backfill_ledger SET rows = %s, committed_at = clock_timestamp() "
    "WHERE backfill_id = %s AND partition = %s"
)


class PartitioningError(DrainError):
    """A row reached a partition other than the one its key hashes to."""


class PartitionError(DrainError):
    """Postgres refused a partition's COPY or commit (the message names the partition)."""


class ConnectionLostError(DrainError):
    """Postgres closed a partition's connection before its commit (terminated, shut
    down, restarted, or the network dropped it): the database is unavailable, not the
    partition's jobs refused. The CLI exits 3 (drain.spark.errors)."""


class ExecutorLost(DrainError):
    """The executor feeding a partition died before its commit: the input may be short."""


class InputCutShortError(DrainError):
    """A partition received fewer records than were counted for it before the write.

    When the executor JVM feeding a Python worker loses its own input (a shuffle
    block on an executor that died), it closes the worker's socket, and a stream
    cut at a batch boundary reads as a clean end: only a count taken beforehand
    tells the partition is short (measured: a 10,000,000-record backfill with an
    executor killed half-way committed 630,170 records too few before this check).
    A stream cut inside an Arrow message fails the read instead; that is lost input
    too, and raised as this error (:func:`drain.spark.task.cut_stream`).
    """


class InjectedFault(RuntimeError):
    """A failure injected on purpose (tests): see :class:`Fault`."""


@dataclasses.dataclass(frozen=True)
class Fault:
    """Fail ``partition``'s first ``attempts`` Spark attempts at ``point`` (for tests).

    ``before_commit`` raises after the COPY, inside the transaction (nothing
    commits); ``after_commit`` raises once the transaction has committed, as
    an executor lost right after its commit would look to Spark.
    """

    partition: int
    point: Literal["before_commit", "after_commit"]
    attempts: int = 1


@dataclasses.dataclass(frozen=True)
class WriterConfig:
    """What every partition's writer needs (pickled to the executors)."""

    database_url: str
    run_id: str
    partitions: int
    #: Identifies this invocation: a partition skipped because this very run
    #: committed it (a retried task) still counts as staged by this run.
    run_token: str
    faults: tuple[Fault, ...] = ()
    chunk_rows: int = _CHUNK_ROWS
    #: Partitions the ledger showed committed when this run started: their input is
    #: filtered out before the shuffle (:func:`drain.spark.mapping.jobs`), and their
    #: tasks return without a connection.
    committed: frozenset[int] = frozenset()
    #: Records per partition, counted before the write (:func:`expected_rows`): a
    #: partition that receives fewer commits nothing. None: no check.
    expected: dict[int, int] | None = None
    #: The partitioning the rows were split by (:func:`drain.spark.ledger.prepare`'s):
    #: each partition checks it against the id's drain_backfills row before its claim
    #: (:func:`drain.spark.ledger.check_claim`). None: only ``partitions`` is checked.
    partitioning: ledger.Partitioning | None = None


@dataclasses.dataclass(frozen=True)
class PartitionResult:
    partition: int
    #: Jobs staged by this run in the partition.
    rows: int
    #: True when the partition had been committed before this attempt started.
    skipped: bool = False
    #: ... by an earlier attempt of this same run (a task retried after its commit).
    retried_after_commit: bool = False


@dataclasses.dataclass(frozen=True)
class WriteSummary:
    """What a write did: rows staged, partitions written or found committed, time."""

    run_id: str
    partitions: int
    rows: int
    written: int
    skipped_earlier_run: int
    retried_after_commit: int
    seconds: float
    attempts: ledger.Attempts = dataclasses.field(default_factory=ledger.Attempts)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "attempts": self.attempts.as_dict(),
                "rows_per_second": round(self.rows_per_second, 1)}


# -- on the driver -------------------------------------------------------------------


def write(lines: DataFrame, config: WriterConfig, *, arrow: bool | None = None) -> WriteSummary:
    """Stage ``lines`` (``_bucket``, ``line``: see :func:`drain.spark.mapping.copy_lines`),
    whose partition ``i`` holds exactly the rows of bucket ``i``.

    With ``arrow`` (the default when pyarrow and pandas are installed), each
    partition receives Arrow batches and COPYs their string buffers as they
    are: no Python object per row. Without, it iterates over rows.
    """
    if arrow is None:
        arrow = arrow_available()
    started = time.monotonic()
    if arrow:
        with warnings.catch_warnings():
            # pyspark warns about pandas versions it has not certified; Arrow is all we use.
            warnings.simplefilter("ignore", FutureWarning)
            results = [
                PartitionResult(r.partition, r.rows, r.skipped, r.retried_after_commit)
                for r in lines.select("_bucket", "line")
                .mapInArrow(functools.partial(write_arrow_partition, config), _RESULT_SCHEMA)
                .collect()
            ]
    else:
        results = (
            lines.select("_bucket", "line")
            .rdd.mapPartitionsWithIndex(functools.partial(write_row_partition, config))
            .collect()
        )
    seconds = time.monotonic() - started
    # Spark may run fewer tasks than partitions (none at all for an empty input), never
    # more, and never one partition twice in the results.
    indexes = [r.partition for r in results]
    if len(set(indexes)) != len(indexes) or not set(indexes) <= set(range(config.partitions)):
        raise PartitioningError(
            f"expected partitions 0..{config.partitions - 1} once each, Spark ran "
            f"{sorted(indexes)}: the input was not partitioned by drain.spark.mapping.jobs"
        )
    attempts = ledger.attempts(config.database_url, config.run_token)
    if attempts.committed_twice:  # the ledger's primary key rules it out
        raise PartitioningError(
            f"partitions {list(attempts.committed_twice)} were committed by more than one "
            "attempt of this run: check drain_backfill_attempts and staged_jobs"
        )
    return WriteSummary(
        run_id=config.run_id,
        partitions=config.partitions,
        rows=sum(r.rows for r in results),
        written=sum(1 for r in results if not r.skipped or r.retried_after_commit),
        skipped_earlier_run=sum(1 for r in results if r.skipped and not r.retried_after_commit),
        retried_after_commit=sum(1 for r in results if r.retried_after_commit),
        seconds=seconds,
        attempts=attempts,
    )


def expected_rows(jobs_source: DataFrame, key: str, partitions: int) -> dict[int, int]:
    """Records per partition of ``jobs_source`` (the records about to be written, before
    the shuffle): one narrow pass reading only what the key needs, 8 bytes per
    partition back to the driver. The same pass refuses a NULL key (StagingError)
    before anything is written: otherwise the partitions without one would commit
    while the one with it fails.
    """
    from pyspark.sql import functions as F  # noqa: PLC0415

    record_key = F.expr(key)
    rows = jobs_source.groupBy(partition_of(record_key, partitions).alias("p")).agg(
        F.count(F.lit(1)).alias("n"), F.count_if(record_key.isNull()).alias("nulls"),
    ).collect()
    if any(r["nulls"] for r in rows):
        raise StagingError(f"a record's key ({key}) is NULL; nothing was staged")
    return {int(r["p"]): int(r["n"]) for r in rows}


def arrow_available() -> bool:
    """pyspark's mapInArrow needs pyarrow, and checks that pandas is installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("pyarrow", "pandas"))


# -- on the executors ----------------------------------------------------------------


def _fault(config: WriterConfig, index: int, point: str) -> None:
    for fault in config.faults:
        if (fault.partition == index and fault.point == point
                and task.current_attempt().number < fault.attempts):
            raise InjectedFault(f"injected failure {point} in partition {index}")


def write_arrow_partition(config: WriterConfig, batches: Iterable[Any]) -> Iterator[Any]:
    """mapInArrow: stage the partition's Arrow batches; yields one result batch."""
    import pyarrow as pa  # noqa: PLC0415

    index = task.partition_id()
    result = _write_partition(config, index, _arrow_chunks(index, batches))
    schema = pa.schema([
        ("partition", pa.int32()), ("rows", pa.int64()), ("skipped", pa.bool_()),
        ("retried_after_commit", pa.bool_()),
    ])
    yield pa.RecordBatch.from_pylist([dataclasses.asdict(result)], schema=schema)


def write_row_partition(
    config: WriterConfig, index: int, rows: Iterable[tuple[int, str]]
) -> Iterator[PartitionResult]:
    """mapPartitionsWithIndex: stage the partition's rows; yields one result."""
    yield _write_partition(config, index, _row_chunks(index, rows, config.chunk_rows))


def _misplaced(bucket: int, index: int) -> PartitioningError:
    return PartitioningError(
        f"a row of partition {bucket} reached partition {index}: the rows are not "
        "hash-partitioned on their key as drain expects, so retries would not be "
        "idempotent; nothing of this partition was staged"
    )


def _arrow_chunks(index: int, batches: Iterable[Any]) -> Iterator[tuple[int, bytes | memoryview]]:
    """Each batch's lines as one buffer: Arrow keeps a string column's characters
    contiguous, and every line ends with a newline, so the buffer is COPY input."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    for batch in _read_input(index, batches):
        if batch.num_rows == 0:
            continue
        buckets, lines = batch.column(0), batch.column(1)
        if lines.null_count:
            raise DrainError(f"partition {index}: a job line is NULL")
        wrong = pc.filter(buckets, pc.not_equal(buckets, index))
        if len(wrong):
            raise _misplaced(wrong[0].as_py(), index)
        _, offsets, data = lines.buffers()
        bounds = memoryview(offsets).cast("q" if pa.types.is_large_string(lines.type) else "i")
        start, end = bounds[lines.offset], bounds[lines.offset + len(lines)]
        yield batch.num_rows, memoryview(data)[start:end]


def _read_input(index: int, batches: Iterable[Any]) -> Iterator[Any]:
    """``batches``; a stream cut inside a message raises InputCutShortError, not
    pyarrow's ``ArrowInvalid: Tried reading schema message, was null or length 0``."""
    stream = iter(batches)
    while True:
        try:
            batch = next(stream, None)
        except (ValueError, OSError) as exc:
            if not task.cut_stream(exc):
                raise
            raise InputCutShortError(
                f"partition {index}: its input was cut short inside an Arrow message "
                f"({type(exc).__name__}: {first_line(exc)}), as when the executor feeding it "
                "is lost; nothing of it was staged, Spark retries it"
            ) from exc
        if batch is None:
            return
        yield batch


def _row_chunks(
    index: int, rows: Iterable[tuple[int, str]], chunk_rows: int
) -> Iterator[tuple[int, bytes | memoryview]]:
    chunk: list[str] = []
    for bucket, line in rows:
        if bucket != index:
            raise _misplaced(bucket, index)
        chunk.append(line)
        if len(chunk) >= chunk_rows:
            yield len(chunk), "".join(chunk).encode()
            chunk.clear()
    if chunk:
        yield len(chunk), "".join(chunk).encode()


def _write_partition(
    config: WriterConfig, index: int, chunks: Iterable[tuple[int, bytes | memoryview]]
) -> PartitionResult:
    feeder = task.feeder()
    chunks = iter(chunks)
    if index in config.committed:
        # Committed before this run: its records were filtered out before the shuffle.
        first = next(chunks, None)
        if first is None:
            return PartitionResult(index, 0, skipped=True)
        chunks = itertools.chain([first], chunks)
    name = f"drain backfill {config.run_id} p{index}"
    with psycopg.connect(config.database_url, connect_timeout=10, autocommit=True,
                         application_name=name[:63]) as conn:
        attempt = ledger.attempt_started(
            conn, run_id=config.run_id, run_token=config.run_token, partition=index,
            attempt=task.current_attempt(), host=task.host(),
        )
        try:
            result = _transaction(conn, config, index, chunks, feeder)
        except psycopg.Error as exc:
            error: Exception = ConnectionLostError(
                f"Postgres closed partition {index}'s connection ({first_line(exc)}); "
                "nothing of it was staged"
            ) if _connection_lost(conn, exc) else PartitionError(
                f"partition {index}: Postgres refused it: {_cause(exc)}; nothing of it was "
                "staged"
            )
            _ended(conn, attempt, f"{ledger.FAILED}: {error}")
            raise error from None
        except Exception as exc:
            _ended(conn, attempt, f"{ledger.FAILED}: {type(exc).__name__}: {exc}")
            raise
        _ended(conn, attempt, ledger.FOUND_COMMITTED if result.skipped else ledger.COMMITTED)
        if result.skipped:
            return result
        _fault(config, index, "after_commit")
    return result


def _ended(conn: psycopg.Connection[tuple[Any, ...]], attempt: int, outcome: str) -> None:
    """Record how the attempt ended, if the connection still works (best effort: an
    attempt without an outcome is reported as stopped or lost)."""
    with contextlib.suppress(psycopg.Error):
        ledger.attempt_ended(conn, attempt, outcome)


#: SQLSTATEs of a server that ends the session: terminated by an administrator
#: (pg_terminate_backend, a fast shutdown), crash recovery, starting up or shutting down.
_SESSION_ENDED = ("57P01", "57P02", "57P03")


def _connection_lost(conn: psycopg.Connection[tuple[Any, ...]], exc: psycopg.Error) -> bool:
    """The error ended the connection (not a refusal of what the partition sent)."""
    state = exc.sqlstate or ""
    return conn.broken or state in _SESSION_ENDED or state.startswith("08")


def _cause(exc: psycopg.Error) -> str:
    """Postgres' message and, for a COPY, the line and column it stopped at."""
    text = first_line(exc)
    context = (exc.diag.context or "").strip().splitlines()
    return f"{text} ({context[0]})" if context else text


def _transaction(
    conn: psycopg.Connection[tuple[Any, ...]], config: WriterConfig, index: int,
    chunks: Iterable[tuple[int, bytes | memoryview]], feeder: tuple[int, int] | None,
) -> PartitionResult:
    with conn.transaction():
        ledger.check_claim(conn, config.run_id, index, config.partitions, config.partitioning)
        claimed = conn.execute(
            _CLAIM, (config.run_id, index, config.partitions, config.run_token)
        ).fetchone()
        if claimed is None:  # committed before: by this run (a retry) or an earlier one
            earlier = conn.execute(_EARLIER, (config.run_id, index)).fetchone()
            assert earlier is not None
            this_run = earlier[1] == config.run_token
            return PartitionResult(index, int(earlier[0]) if this_run else 0,
                                   skipped=True, retried_after_commit=this_run)
        count = 0
        with conn.cursor().copy(_COPY) as copy:
            for rows, payload in chunks:
                copy.write(payload)
                count += rows
        _fault(config, index, "before_commit")
        wanted = (config.expected or {}).get(index, 0)
        if config.expected is not None and count < wanted:
            raise InputCutShortError(
                f"partition {index}: received {count:,} of its {wanted:,} records (its input "
                "was cut short, e.g. a shuffle read from a lost executor, or the source lost "
                "records during the run); nothing of it was staged, Spark retries it"
            )
        if task.feeder() != feeder:
            raise ExecutorLost(
                f"partition {index}: the executor feeding it died while it was written "
                "(its input may be cut short); nothing of it was staged, Spark retries it"
            )
        conn.execute(_COUNT, (count, config.run_id, index))
    return PartitionResult(index, count)
