"""What a partition records about itself, on real Spark and Postgres.

* ``drain_backfill_ledger.committed_at`` is taken at the transaction's last
  statement, not its start (``now()``): never earlier than its COPY.
* A retry in a new attempt of its stage reads ``attempt`` 0 again (Spark's
  attemptNumber() restarts per stage attempt); ``task_attempt_id`` (Spark's
  TID) tells the two attempts apart.
* An Arrow input stream cut inside a message (the executor feeding the worker
  was lost) fails the partition as lost input (InputCutShortError), not as
  pyarrow's ``ArrowInvalid: Tried reading schema message, was null or length 0``.
* A schema without task_attempt_id is refused until `drain migrate` adds it.
* A partition whose run writes another partitioning than the id's
  drain_backfills row records is refused at its claim, staging nothing.
"""

from __future__ import annotations

import functools
import io
import re
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from drain.cli import spark as cli
from drain.errors import PartitioningChanged, SchemaMissing
from drain.postgres import migration
from drain.spark import backfill, ledger, mapping, writer
from tests.spark import helpers

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

TASK = "search.index_annotation"
M = mapping.Mapping(task_name=TASK, key="id", tag="backfill.records",
                    kwargs=(("annotation_id", "id"),))


def _lines(run_id: str, keys: range) -> bytes:
    """COPY input for ``keys`` (one partition)."""
    return "".join(
        f"{mapping.task_id_for(run_id, str(k))},\"{TASK}\",\"[]\",\"{{}}\",\"celery\",-10,"
        f"\"backfill.records\",,\n" for k in keys
    ).encode()


def test_committed_at_is_not_earlier_than_the_partitions_last_write(
    spark: SparkSession, db_url: str
) -> None:
    """Before: committed_at was now(), the transaction's start: 0.3 s before its COPY
    ended here (the trigger makes the COPY take that long)."""
    helpers.execute(
        db_url,
        "CREATE TABLE copy_ended (at timestamptz NOT NULL)",
        """CREATE FUNCTION on_copy() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_sleep(0.3);
            INSERT INTO copy_ended VALUES (clock_timestamp());
            RETURN NULL;
        END $$""",
        "CREATE TRIGGER on_copy AFTER INSERT ON staged_jobs FOR EACH STATEMENT "
        "EXECUTE FUNCTION on_copy()",
    )
    options = backfill.Options(database_url=db_url, run_id="timed", partitions=1)
    assert backfill.run(spark, spark.range(0, 100), M, options).summary.rows == 100
    with psycopg.connect(db_url) as conn:
        row = conn.execute(
            "SELECT l.committed_at, (SELECT max(at) FROM copy_ended), a.ended_at "
            "FROM drain_backfill_ledger l JOIN drain_backfill_attempts a "
            "ON a.backfill_id = l.backfill_id AND a.partition = l.partition "
            "WHERE l.backfill_id = 'timed'"
        ).fetchone()
    assert row is not None
    committed_at, copy_ended, attempt_ended = row
    print(f"committed_at - end of COPY: {(committed_at - copy_ended).total_seconds():+.3f}s")
    assert copy_ended <= committed_at <= attempt_ended


def _retried_stage(config: writer.WriterConfig, lines: Any) -> list[writer.PartitionResult]:
    """Write ``lines`` in a barrier stage followed by a shuffle: when a task of a barrier
    stage fails, Spark attempts the whole stage again, as it does after a fetch
    failure, and each retried task is attemptNumber() 0 of the new stage attempt."""
    rdd = lines.select("_bucket", "line").rdd.barrier().mapPartitionsWithIndex(
        functools.partial(writer.write_row_partition, config))
    results: list[writer.PartitionResult] = rdd.repartition(1).collect()
    return results


def test_a_retry_in_a_new_stage_attempt_is_told_apart_from_the_first(
    spark: SparkSession, db_url: str
) -> None:
    """Before: both attempts at partition 1 read attempt 0 and nothing else told them
    apart; now each has its own Spark task attempt id."""
    partitioning = ledger.Partitioning(2, "id", "bigint")
    ledger.prepare(db_url, "restaged", partitioning)
    helpers.on_first_commit(db_url, 1, "RAISE EXCEPTION 'refused at commit (test)'")
    lines = mapping.copy_lines(mapping.jobs(spark.range(0, 100), M, "restaged", 2), M)
    config = writer.WriterConfig(db_url, "restaged", 2, run_token=str(uuid.uuid4()),
                                 partitioning=partitioning)
    results = _retried_stage(config, lines)
    assert sum(r.rows for r in results) == 100
    assert sum(helpers.ledger(db_url, "restaged").values()) == 100
    first, retry = helpers.attempts(db_url, "restaged", 1)
    assert first["outcome"].startswith("failed: partition 1: Postgres refused it: refused at")
    assert retry["outcome"] == "committed"
    assert (first["attempt"], retry["attempt"]) == (0, 0)  # attemptNumber() restarted
    assert None not in (first["task_attempt_id"], retry["task_attempt_id"])
    assert retry["task_attempt_id"] > first["task_attempt_id"]


def _arrow_stream(run_id: str, keys: range) -> bytes:
    """The Arrow IPC stream a Python worker reads: batches of (_bucket, line)."""
    import pyarrow as pa

    lines = _lines(run_id, keys).decode().splitlines(keepends=True)
    table = pa.table({"_bucket": pa.array([0] * len(lines), pa.int32()), "line": lines})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as out:
        for batch in table.to_batches(max_chunksize=10):
            out.write_batch(batch)
    return sink.getvalue()


@pytest.mark.parametrize("cut", ["before-the-schema", "inside-a-batch"])
def test_an_arrow_stream_cut_inside_a_message_is_lost_input(db_url: str, cut: str) -> None:
    """Before: the attempt was recorded as failed: ArrowInvalid: Tried reading schema
    message, was null or length 0 (or Expected to read N metadata bytes, ...)."""
    from pyspark.sql.pandas.serializers import ArrowStreamSerializer

    ledger.prepare(db_url, "cut", ledger.Partitioning(1, "id", "bigint"))
    config = writer.WriterConfig(db_url, "cut", 1, run_token=str(uuid.uuid4()))
    stream = _arrow_stream("cut", range(50))
    # What pyspark's own reader makes of a socket the executor closed mid-stream.
    received = stream[: 0 if cut == "before-the-schema" else len(stream) // 2 + 3]
    batches = ArrowStreamSerializer().load_stream(io.BytesIO(received))
    with pytest.raises(writer.InputCutShortError,
                       match=r"^partition 0: its input was cut short inside an Arrow message "
                             r"\((ArrowInvalid|OSError): .+\), as when the executor feeding it "
                             r"is lost; nothing of it was staged, Spark retries it$"):
        writer._write_partition(config, 0, writer._arrow_chunks(0, batches))
    [attempt] = helpers.attempts(db_url, "cut", 0)
    assert attempt["outcome"].startswith("failed: InputCutShortError: partition 0: its input "
                                         "was cut short")
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "cut") == {}


def test_a_partition_of_another_partitioning_than_the_ids_is_refused_at_its_claim(
    db_url: str
) -> None:
    """A driver prepared the id with 4 partitions; its drain_backfills row was then
    deleted and claimed again by a driver with 8. Before: the first driver's partitions
    committed as partitions of 4 under an id now of 8 (so its records would be staged
    again in other partitions); now each is refused before its claim."""
    ledger.prepare(db_url, "moved", ledger.Partitioning(4, "id", "bigint"))
    helpers.execute(db_url, "DELETE FROM drain_backfills WHERE backfill_id = 'moved'")
    ledger.prepare(db_url, "moved", ledger.Partitioning(8, "id", "bigint"))
    first = writer.WriterConfig(db_url, "moved", 4, run_token=str(uuid.uuid4()),
                                partitioning=ledger.Partitioning(4, "id", "bigint"))
    with pytest.raises(PartitioningChanged,
                       match=r"^partition 0: backfill id 'moved' is recorded in drain_backfills "
                             r"with 8 partitions, this run writes 4: its records would get "
                             r"other partitions; nothing of it was staged$"):
        writer._write_partition(first, 0, [(3, _lines("moved", range(3)))])
    # Another key (or key type) than the row's is refused the same way.
    rekeyed = writer.WriterConfig(db_url, "moved", 8, run_token=str(uuid.uuid4()),
                                  partitioning=ledger.Partitioning(8, "uid", "string"))
    with pytest.raises(PartitioningChanged, match="with key 'id' \\(bigint, hash version 2\\), "
                                                  "this run writes key 'uid' \\(string"):
        writer._write_partition(rekeyed, 0, [(3, _lines("moved", range(3)))])
    helpers.execute(db_url, "DELETE FROM drain_backfills WHERE backfill_id = 'moved'")
    with pytest.raises(PartitioningChanged, match="has no drain_backfills row"):
        writer._write_partition(first, 0, [(3, _lines("moved", range(3)))])
    assert helpers.staged(db_url) == []
    assert helpers.ledger(db_url, "moved") == {}
    outcomes = [a["outcome"] for a in helpers.attempts(db_url, "moved", 0)]
    assert len(outcomes) == 3
    assert all(o.startswith("failed: PartitioningChanged: partition 0: ") for o in outcomes)


def test_a_schema_without_task_attempt_id_is_refused_until_drain_migrate(db_url: str) -> None:
    """A database an older drain migrated: its attempts table lacks the column, and
    every executor's INSERT would fail; the driver says so first (exit 4), and
    `drain migrate` (twice: it is idempotent) adds it, keeping the rows there."""
    helpers.execute(
        db_url, "ALTER TABLE drain_backfill_attempts DROP COLUMN task_attempt_id",
        "INSERT INTO drain_backfill_attempts (backfill_id, run_token, partition, attempt) "
        "VALUES ('old', gen_random_uuid(), 0, 0)",
    )
    with pytest.raises(SchemaMissing, match=r"older drain schema \(no column "
                                            r"drain_backfill_attempts.task_attempt_id\): run "
                                            r"`drain migrate`"):
        ledger.prepare(db_url, "upgraded", ledger.Partitioning(1, "id", "bigint"))
    for _ in range(2):
        with psycopg.connect(db_url) as conn:
            migration.migrate(conn)
    ledger.prepare(db_url, "upgraded", ledger.Partitioning(1, "id", "bigint"))
    assert helpers.attempts(db_url, "old", 0)[0]["task_attempt_id"] is None


def test_a_claim_refused_in_a_spark_task_is_partitioning_changed_exit_6(
    spark: SparkSession, db_url: str
) -> None:
    """The refusal above, raised in Spark's tasks and given up on by Spark, reaches the
    CLI as PartitioningChanged (exit 6), not as 'Spark failed' (exit 1): before, the
    name of the executor's exception was not one the translation read."""
    ledger.prepare(db_url, "moved", ledger.Partitioning(4, "id", "bigint"))
    helpers.execute(db_url, "DELETE FROM drain_backfills WHERE backfill_id = 'moved'")
    ledger.prepare(db_url, "moved", ledger.Partitioning(8, "id", "bigint"))
    df = spark.range(0, 40)
    config = writer.WriterConfig(db_url, "moved", 4, run_token=str(uuid.uuid4()),
                                 partitioning=ledger.Partitioning(4, "id", "bigint"))
    with pytest.raises(PartitioningChanged) as raised, cli.spark_errors():
        writer.write(mapping.copy_lines(mapping.jobs(df, M, "moved", 4), M), config)
    assert re.match(r"partition \d: backfill id 'moved' is recorded in drain_backfills with 8 "
                    r"partitions, this run writes 4", str(raised.value)), str(raised.value)
    assert "\n" not in str(raised.value)
    assert helpers.staged(db_url) == []
