"""``drain backfill``: stage one job per record of a dataset, idempotently.

``source -> where -> mapping.jobs (hash-partitioned on the key) ->
mapping.copy_lines -> writer.write`` (one transaction per partition, recorded
in the ledger). See :mod:`drain.spark.writer` for the guarantees.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

import psycopg

from drain import trace_context
from drain.errors import ConfigError, DrainError
from drain.settings.url_parts import first_line
from drain.spark import ledger, progress, rejects, writer
from drain.spark import mapping as mapping_

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

#: Write partitions per core of the session, when neither --partitions nor an earlier
#: run of the same id says otherwise (each partition is one task and one transaction).
PARTITIONS_PER_CORE = 4


def default_partitions(spark: SparkSession) -> int:
    """``PARTITIONS_PER_CORE`` x the session's default parallelism (at least 4)."""
    return max(4, PARTITIONS_PER_CORE * int(spark.sparkContext.defaultParallelism))


@dataclasses.dataclass(frozen=True)
class Options:
    """How to run a backfill (besides the source and the mapping)."""

    database_url: str
    #: The backfill id: a re-run with the same id stages only what never committed.
    run_id: str
    #: Fixed for a backfill id: a record's partition is hash(key) mod this count.
    partitions: int = 8
    #: The user chose ``partitions`` (--partitions): a run of an id started with another
    #: count is refused; otherwise it adopts the id's count.
    partitions_explicit: bool = True
    #: A Spark SQL condition on the source's records.
    where: str | None = None
    progress: bool = False
    #: Arrow batches (None: when pyarrow and pandas are installed).
    arrow: bool | None = None
    faults: tuple[writer.Fault, ...] = ()
    #: Write records that can never become a job here (JSON lines) and stage the rest;
    #: None: the first such record fails the run before anything is staged.
    rejects_file: str | None = None


@dataclasses.dataclass(frozen=True)
class Result:
    """What ``drain backfill`` prints at the end."""

    summary: writer.WriteSummary
    #: Every partition had been committed before: nothing was read or staged.
    already_complete: bool
    #: Wall time of the whole command (including planning and the ledger check).
    seconds: float
    #: Records refused before the write (listed in the rejects file).
    rejected: int = 0
    rejects_file: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {**self.summary.as_dict(), "already_complete": self.already_complete,
                "total_seconds": round(self.seconds, 3), "rejected": self.rejected,
                "rejects_file": self.rejects_file}

    def text(self) -> str:
        s = self.summary
        if self.already_complete:
            return (f"backfill {s.run_id!r}: already complete ({s.partitions} partitions "
                    "committed by earlier runs); staged nothing. Use a new --id to stage again.")
        notes = []
        if s.skipped_earlier_run:
            notes.append(f"{s.skipped_earlier_run} committed by an earlier run, skipped")
        if s.retried_after_commit:
            notes.append(f"{s.retried_after_commit} retried after their commit, not restaged")
        if s.attempts.extra:
            notes.append(s.attempts.text())
        if self.rejected:
            notes.append(f"{self.rejected:,} record(s) refused, listed in {self.rejects_file}")
        note = f" ({'; '.join(notes)})" if notes else ""
        return (f"backfill {s.run_id!r}: staged {s.rows:,} job(s) in {s.partitions} "
                f"partitions{note} in {s.seconds:.1f}s, {s.rows_per_second:,.0f} rows/s")


def check(m: mapping_.Mapping, options: Options) -> None:
    """Refuse a malformed mapping or id before any Spark work (ConfigError, StagingError)."""
    m.validate()
    mapping_.validate_run_id(options.run_id)
    if options.partitions < 1:
        raise ConfigError("--partitions must be at least 1")


def plan(df: DataFrame, m: mapping_.Mapping, options: Options) -> DataFrame:
    """The jobs the backfill would stage (lazy)."""
    if options.where:
        df = df.filter(options.where)
    return mapping_.jobs(df, m, options.run_id, options.partitions)


def partitioning(df: DataFrame, m: mapping_.Mapping, partitions: int) -> ledger.Partitioning:
    """What the partitioning of ``df``'s records by ``m.key`` depends on."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    key_type = df.select(F.expr(m.key)).schema.fields[0].dataType.simpleString()
    return ledger.Partitioning(partitions, m.key, key_type)


def dry_run(df: DataFrame, m: mapping_.Mapping, options: Options, sample: int) -> dict[str, Any]:
    """How many jobs a run would stage given the ledger (the partitions committed by
    earlier runs of the id are skipped) and the records it would refuse
    (:func:`drain.spark.rejects.split`), and the first ``sample`` of each (by key)."""
    check(m, options)
    unread = None
    try:
        recorded, state = ledger.recorded_state(options.database_url, options.run_id)
    except (DrainError, psycopg.Error) as exc:  # a dry run works without the ledger
        recorded, state, unread = None, ledger.LedgerState(None, 0), first_line(exc)
    if recorded is not None and not options.partitions_explicit:
        options = dataclasses.replace(options, partitions=recorded.partitions)
    elif recorded is None and state.partitions is not None:
        options = dataclasses.replace(options, partitions=state.partitions)
    if options.where:
        df = df.filter(options.where)
        options = dataclasses.replace(options, where=None)
    if recorded is not None:  # what a run would refuse, the dry run refuses too
        ledger.check_resume(options.run_id, recorded, partitioning(df, m, options.partitions),
                            options.partitions_explicit, state)
    complete = state.partitions is not None and state.committed >= state.partitions
    if recorded is None and state.indexes and not complete:
        raise ledger.unrecorded(options.run_id, state)
    df = mapping_.without_partitions(df, m, options.partitions, state.indexes)
    rejected, refused_rows = 0, []
    if not complete:  # the split a run makes (rejects.check), without writing the file
        df, refused = rejects.split(df, m, options.partitions)
        if refused is not None and options.rejects_file is None:
            rejects.stop_at_first(refused)
        elif refused is not None:
            rejected = refused.count()
            refused_rows = (refused.orderBy("key").limit(sample).collect()
                            if sample > 0 and rejected else [])
    jobs = plan(df, m, options)
    rows = jobs.orderBy("_key").limit(sample).collect() if sample > 0 and not complete else []
    return {
        "backfill_id": options.run_id,
        "count": 0 if complete else jobs.count(),
        "partitions": options.partitions,
        "committed_partitions": state.committed,
        "committed_rows": state.rows,
        #: Why the ledger could not be read (the count then assumes nothing committed).
        "ledger_unread": unread,
        #: Records a run would refuse (with --rejects; without, the dry run refuses).
        "rejected": rejected,
        "rejects_file": options.rejects_file,
        "rejected_sample": [r.asDict() for r in refused_rows],
        "sample": [
            {
                "task_id": r["task_id"], "task_name": m.task_name,
                "args": json.loads(r["args"]), "kwargs": json.loads(r["kwargs"]),
                "queue": m.queue, "priority": m.priority, "tag": m.tag,
                "not_before": r["not_before"],
            }
            for r in rows
        ],
    }


def run(spark: SparkSession, df: DataFrame, m: mapping_.Mapping, options: Options) -> Result:
    """Stage one job per record of ``df``; safe to re-run with the same id."""
    started = time.monotonic()
    check(m, options)
    if options.where:
        df = df.filter(options.where)
    actual, state = ledger.prepare(options.database_url, options.run_id,
                                   partitioning(df, m, options.partitions),
                                   explicit=options.partitions_explicit)
    options = dataclasses.replace(options, partitions=actual.partitions, where=None)
    if state.committed >= options.partitions:
        summary = writer.WriteSummary(
            run_id=options.run_id, partitions=options.partitions, rows=0, written=0,
            skipped_earlier_run=state.committed, retried_after_commit=0, seconds=0.0,
        )
        return Result(summary, already_complete=True, seconds=time.monotonic() - started)
    # A resume: the committed partitions' records go no further than the read.
    df = mapping_.without_partitions(df, m, options.partitions, state.indexes)
    df, rejected = rejects.check(df, m, options.partitions, options.rejects_file)
    config = writer.WriterConfig(
        database_url=options.database_url, run_id=options.run_id,
        partitions=options.partitions, run_token=str(uuid.uuid4()), faults=options.faults,
        committed=state.indexes,
        # A partition whose input is cut short must not commit (writer.InputCutShortError).
        expected=writer.expected_rows(df, m.key, options.partitions), partitioning=actual,
    )
    # One trace per run: every job it stages carries the run's span's context.
    with trace_context.run_span("backfill", options.run_id, config.run_token) as trace:
        m = dataclasses.replace(m, trace=trace)
        lines = mapping_.copy_lines(mapping_.jobs(df, m, options.run_id, options.partitions), m)
        with progress.tracking(spark.sparkContext, "backfill", enabled=options.progress):
            summary = writer.write(lines, config, arrow=options.arrow)
    return Result(summary, already_complete=False, seconds=time.monotonic() - started,
                  rejected=rejected, rejects_file=options.rejects_file)
