"""From records to staged_jobs rows, computed in Spark (in the JVM, not in Python).

Every record becomes one job:

* **task id** = ``uuid5(NAMESPACE, f"{run_id}\\x1f{key}")`` where ``key`` is
  the record's key cast to a Spark string (:func:`task_id_for` computes the
  same in Python). The same record in the same backfill always gets the same
  task id, so even a duplicate row would carry the task id consumers dedupe on.
* **args / kwargs**: JSON built from columns (``--args a,b``; ``--kwargs
  annotation_id=id,user_id``) or from a Spark SQL expression returning an
  array (``--args-expr``) or a struct/map (``--kwargs-expr``).
* **task name, queue, priority, tag**: constants of the run.
* **not_before**: with a spread, ``start + (xxhash64(key) mod window)``:
  evenly over ``[start, start + window)`` and the same for a record however
  often its partition is retried.

:func:`copy_lines` encodes each job as one line of ``COPY staged_jobs (...)
FROM STDIN (FORMAT csv)``, so that the Python writer only forwards text.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import uuid
from collections.abc import Collection
from typing import TYPE_CHECKING, Any

from drain.errors import ConfigError
from drain.staging_values import row

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: The uuid5 namespace of drain's deterministic task ids.
NAMESPACE = uuid.UUID("6f1d3c52-4b1e-5f0a-9c57-2f8f1e0d7a31")
#: Separates the run id from the key in the uuid5 name; refused in run ids.
SEPARATOR = "\x1f"
DEFAULT_PRIORITY = -10
#: The columns COPY writes, in the order of a :func:`copy_lines` line.
COPY_COLUMNS = (
    "task_id", "task_name", "args", "kwargs", "queue", "priority", "tag", "not_before",
    "expires_at", "trace",
)
_JSON_OPTIONS = {"ignoreNullFields": "false"}
#: A source's column saying why a row is malformed (NULL: it is not), as a CSV source
#: has it (drain.spark.sources): never part of a record, its rows become rejects.
MALFORMED = "_drain_malformed"


def task_id_for(run_id: str, key: str) -> uuid.UUID:
    """The task id drain gives the record with key ``key`` (its Spark string) in ``run_id``."""
    return uuid.uuid5(NAMESPACE, f"{run_id}{SEPARATOR}{key}")


def parse_columns(text: str) -> tuple[tuple[str, str], ...]:
    """``"annotation_id=id,user_id"`` -> ``(("annotation_id", "id"), ("user_id", "user_id"))``."""
    pairs = []
    for item in text.split(","):
        name, _, column = item.strip().partition("=")
        name, column = name.strip(), (column.strip() or name.strip())
        if not name:
            raise ConfigError(f"bad column list {text!r}: expected NAME[=COLUMN],...")
        pairs.append((name, column))
    return tuple(pairs)


@dataclasses.dataclass(frozen=True)
class Mapping:
    """How a record becomes a job. Expressions are Spark SQL."""

    task_name: str
    #: The record's key: a column or expression, unique per record.
    key: str
    tag: str
    #: Positional arguments: columns, in order (the names are unused).
    args: tuple[tuple[str, str], ...] = ()
    args_expr: str | None = None
    #: Keyword arguments: ``(name, column)`` pairs.
    kwargs: tuple[tuple[str, str], ...] = ()
    kwargs_expr: str | None = None
    #: None: no queue given (NULL), as drain.stage: `drain run --app` routes the jobs.
    queue: str | None = None
    priority: int = DEFAULT_PRIORITY
    #: Spread not_before over ``[spread_start, spread_start + spread)``.
    spread: dt.timedelta | None = None
    spread_start: dt.datetime | None = None
    #: The run's OpenTelemetry context, the same for every job (``staged_jobs.trace``,
    #: JSON text; drain.trace_context.run_span); None: none.
    trace: str | None = None

    def validate(self) -> None:
        """Refuse what staged_jobs would refuse (StagingError), before Spark runs."""
        if not self.tag:
            raise ConfigError("a tag is required (e.g. backfill.reindex): it names the jobs")
        if self.args and self.args_expr:
            raise ConfigError("give the args as columns or as an expression, not both")
        if self.kwargs and self.kwargs_expr:
            raise ConfigError("give the kwargs as columns or as an expression, not both")
        if self.spread is not None and self.spread <= dt.timedelta(0):
            raise ConfigError("the spread must be a positive duration")
        row(self.task_name, (), {}, self.queue, None, priority=self.priority, tag=self.tag)


def validate_run_id(run_id: str) -> None:
    """A run (backfill) id is 1..200 characters of text without the separator."""
    if not run_id or len(run_id) > 200 or SEPARATOR in run_id or "\x00" in run_id:
        raise ConfigError(f"bad backfill id {run_id!r}: 1 to 200 characters, no control chars")


def partition_of(key: Column, partitions: int) -> Column:
    """The partition a record's key belongs to: ``pmod(murmur3(cast(key as string)),
    partitions)`` (hash version 2, :data:`drain.spark.ledger.HASH_VERSION`), the
    partition :func:`jobs` sends it to. A function of the key's text, which is also
    what its task id is made of: an int key that becomes a bigint keeps its partition.
    Every place that names a record's partition (the writer's check, a resume's skip,
    the counts, the rejects) takes it from here, so they cannot disagree."""
    from pyspark.sql import functions as F  # noqa: PLC0415 - pyspark is optional

    return F.pmod(F.hash(key.cast("string")), F.lit(partitions))


def without_partitions(
    df: DataFrame, mapping: Mapping, partitions: int, skip: Collection[int]
) -> DataFrame:
    """``df`` without the records whose key hashes to one of the ``skip`` partitions
    (those a resumed backfill committed before): filtered as they are read, before
    any shuffle, with the hash :func:`jobs` partitions by."""
    if not skip:
        return df
    from pyspark.sql import functions as F  # noqa: PLC0415 - pyspark is optional

    return df.filter(~partition_of(F.expr(mapping.key), partitions).isin(sorted(skip)))


def jobs(
    df: DataFrame, mapping: Mapping, run_id: str, partitions: int | None
) -> DataFrame:
    """``df`` as jobs, hash-partitioned on the key into ``partitions`` partitions.

    Columns: ``_key``, ``_bucket`` (the partition the key hashes to, which the
    writer checks), ``task_id``, ``args``, ``kwargs`` (JSON text) and
    ``not_before`` (text or NULL). Only the source's columns are shuffled; the
    jobs are computed after the shuffle, in the writing stage. The args and kwargs
    expressions see the source's columns only (``struct(*)`` is the record, with
    no column of drain's). ``partitions=None``
    leaves ``df``'s partitioning alone (and ``_bucket`` NULL): for comparisons only.
    """
    from pyspark.sql import functions as F  # noqa: PLC0415 - pyspark is optional

    df = df.drop(MALFORMED)
    # The key stays an expression, not a column of the frame: a column of drain's would
    # be part of the record a user's struct(*) or array(*) sees.
    key = F.expr(mapping.key)
    args, kwargs = args_json(df, mapping), kwargs_json(df, mapping)
    key_text = F.coalesce(
        key.cast("string"),
        F.raise_error(F.lit(f"a record's key ({mapping.key}) is NULL")),
    )
    not_before: Column = F.lit(None).cast("string")
    if mapping.spread is not None:
        start = mapping.spread_start or dt.datetime.now(dt.timezone.utc)
        window_us = max(1, int(mapping.spread.total_seconds() * 1_000_000))
        moment = F.timestamp_micros(
            F.lit(_micros(start)) + F.pmod(F.xxhash64(key_text), F.lit(window_us))
        )
        not_before = F.date_format(moment, "yyyy-MM-dd HH:mm:ss.SSSSSSXXX")
    if partitions is None:
        partitioned, bucket = df, F.lit(None).cast("int")
    else:
        # Spark's hash partitioning is pmod(murmur3(...), n): partition_of's.
        partitioned = df.repartition(partitions, key.cast("string"))
        bucket = partition_of(key, partitions)
    return partitioned.select(
        key.alias("_key"),
        bucket.alias("_bucket"),
        _uuid5(run_id, key_text).alias("task_id"),
        args.alias("args"),
        kwargs.alias("kwargs"),
        not_before.alias("not_before"),
    )


def copy_lines(jobs_df: DataFrame, mapping: Mapping) -> DataFrame:
    """``jobs_df`` as ``_key``, ``_bucket`` and ``line``: one CSV line of COPY_COLUMNS
    (ending with a newline), in the partitioning of ``jobs_df``."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    def quoted(column: Column) -> Column:
        return F.concat(F.lit('"'), F.replace(column, F.lit('"'), F.lit('""')), F.lit('"'))

    head = f",{_csv(mapping.task_name)},"
    queue = "" if mapping.queue is None else _csv(mapping.queue)  # unquoted empty: NULL
    tail = f",{queue},{mapping.priority},{_csv(mapping.tag)},"
    line = F.concat(
        F.col("task_id"), F.lit(head), quoted(F.col("args")), F.lit(","),
        quoted(F.col("kwargs")), F.lit(tail), F.coalesce(F.col("not_before"), F.lit("")),
        # expires_at: NULL; then the run's trace (unquoted empty: NULL); every line
        # ends with its newline.
        F.lit(",," + ("" if mapping.trace is None else _csv(mapping.trace)) + "\n"),
    )
    return jobs_df.select("_key", "_bucket", line.alias("line"))


def _csv(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


def _micros(moment: dt.datetime) -> int:
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.timezone.utc)
    epoch = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
    delta = moment - epoch
    return (delta.days * 86_400 + delta.seconds) * 1_000_000 + delta.microseconds


def _uuid5(run_id: str, key_text: Column) -> Column:
    """RFC 4122 uuid5 of ``run_id + SEPARATOR + key`` in ``NAMESPACE``, in Spark SQL."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    prefix = bytearray(NAMESPACE.bytes + (run_id + SEPARATOR).encode())
    digest = F.sha1(F.concat(F.lit(prefix), F.encode(key_text, "UTF-8")))
    # The variant bits: the 17th hex digit becomes 10xx in binary.
    variant = F.translate(F.substring(digest, 17, 1), "0123456789abcdef", "89ab89ab89ab89ab")
    return F.concat(
        F.substring(digest, 1, 8), F.lit("-"), F.substring(digest, 9, 4), F.lit("-5"),
        F.substring(digest, 14, 3), F.lit("-"), variant, F.substring(digest, 18, 3),
        F.lit("-"), F.substring(digest, 21, 12),
    )


def args_json(df: DataFrame, mapping: Mapping) -> Column:
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql.types import ArrayType  # noqa: PLC0415

    if mapping.args_expr:
        _require_type(df, mapping.args_expr, (ArrayType,), "--args-expr", "an array")
        # NULL means no args, as drain.stage(args=None).
        return F.coalesce(F.to_json(F.expr(mapping.args_expr), _JSON_OPTIONS), F.lit("[]"))
    if not mapping.args:
        return F.lit("[]")
    for _, column in mapping.args:
        _require_json(df, F.col(column), column, "--args")
    # to_json takes arrays and structs only: each value as a one-element array, unwrapped.
    values = [
        F.regexp_extract(F.to_json(F.array(F.col(column)), _JSON_OPTIONS), r"^\[(.*)\]$", 1)
        for _, column in mapping.args
    ]
    return F.concat(F.lit("["), F.concat_ws(",", *values), F.lit("]"))


def kwargs_json(df: DataFrame, mapping: Mapping) -> Column:
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql.types import MapType, StructType  # noqa: PLC0415

    if mapping.kwargs_expr:
        _require_type(df, mapping.kwargs_expr, (StructType, MapType), "--kwargs-expr",
                      "a struct or a map")
        # NULL means no kwargs, as drain.stage(kwargs=None).
        return F.coalesce(F.to_json(F.expr(mapping.kwargs_expr), _JSON_OPTIONS), F.lit("{}"))
    if not mapping.kwargs:
        return F.lit("{}")
    for _, column in mapping.kwargs:
        _require_json(df, F.col(column), column, "--kwargs")
    return F.to_json(
        F.struct(*[F.col(column).alias(name) for name, column in mapping.kwargs]), _JSON_OPTIONS
    )


def _require_type(df: DataFrame, expression: str, types: tuple[type, ...], flag: str,
                  what: str) -> None:
    from pyspark.sql import functions as F  # noqa: PLC0415

    data_type = df.select(F.expr(expression)).schema.fields[0].dataType
    if not isinstance(data_type, types):
        raise ConfigError(
            f"{flag} must return {what}, but {expression!r} returns {data_type.simpleString()}"
        )
    _require_json(df, F.expr(expression), expression, flag)


def _require_json(df: DataFrame, value: Column, shown: str, flag: str) -> None:
    """Refuse, before any Spark job, a value type JSON cannot hold as drain.stage would
    (Spark's to_json would turn bytes into base64 and a map's keys into strings)."""
    problem = _not_json(df.select(value).schema.fields[0].dataType)
    if problem:
        raise ConfigError(f"{flag} value {shown!r} {problem}, which a job's JSON cannot hold "
                          "as such: convert it in the expression (e.g. base64(...), "
                          "map_from_entries(...) with string keys)")


def _not_json(data_type: Any) -> str | None:
    """What in ``data_type`` JSON cannot hold (binary, a map without string keys)."""
    from pyspark.sql import types as T  # noqa: PLC0415

    if isinstance(data_type, T.BinaryType):
        return "holds binary data"
    if isinstance(data_type, T.MapType):
        if not isinstance(data_type.keyType, T.StringType):
            return f"is a map with {data_type.keyType.simpleString()} keys"
        return _not_json(data_type.valueType)
    if isinstance(data_type, T.ArrayType):
        return _not_json(data_type.elementType)
    if isinstance(data_type, T.StructType):
        return next((p for f in data_type.fields if (p := _not_json(f.dataType))), None)
    return None
