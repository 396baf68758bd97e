"""Where the records come from: files (Parquet, CSV, JSON) or Postgres over JDBC.

A source is written ``KIND:WHAT`` on the command line:

* ``parquet:PATH``, ``csv:PATH`` (with a header line), ``json:PATH`` (JSON
  lines): a file, a directory or a glob, on any filesystem Spark reads
  (``s3a://``, ``hdfs://``...).
* ``table:NAME`` (``schema.name`` works) or ``query:SELECT ...``: read from
  Postgres over JDBC, in parallel when a numeric partition column is given
  (Spark splits ``[min, max]`` of that column into ranges, one query each).

A CSV file is read as text, then typed (:func:`_read_csv`): with ``--schema``
its columns take those types (by position); without, each takes the type
Spark infers, except that a column Spark would make a string because of a few
values is typed int, bigint, double or boolean when more than half of its
non-empty values are. A row with too few or too many fields, or a value its
column's type cannot hold, is malformed: its reason is in the column
:data:`drain.spark.mapping.MALFORMED`, and it becomes a reject
(drain/spark/rejects.py), never a job with a NULL or a changed type.

The same column marks the other malformed records a file can hold:

* a JSON line that does not parse (Spark's PERMISSIVE mode makes it a row of
  NULLs): "malformed JSON line in FILE: <its first 100 characters>";
* a Parquet string (at any depth: in a struct, an array, a map) that is not
  valid UTF-8, which Spark would read as is and write into a job's JSON with
  U+FFFD in place of the bad bytes: "malformed Parquet record: invalid UTF-8
  in column NAME".
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import conninfo
from psycopg import sql as psql

from drain.errors import ConfigError, DatabaseUnavailable
from drain.settings.url_parts import first_line
from drain.settings.urls import mask_database_url, scrub
from drain.spark.mapping import MALFORMED
from drain.spark.session import JDBC_DRIVER

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import StructType

FILE_KINDS = ("parquet", "csv", "json")
#: The types a column Spark infers as a string may take instead, narrowest first.
_RESCUED_TYPES = ("int", "bigint", "double", "boolean")
#: Spark's column for a CSV line with too few or too many fields.
_CORRUPT = "_drain_csv_line"
#: Spark's column for a JSON line that does not parse.
_JSON_LINE = "_drain_json_line"
JDBC_KINDS = ("table", "query")
KINDS = FILE_KINDS + JDBC_KINDS


@dataclasses.dataclass(frozen=True)
class Source:
    """One source: ``kind`` (parquet, csv, json, table, query) and what to read."""

    kind: str
    target: str

    @classmethod
    def parse(cls, text: str) -> Source:
        """``"parquet:/data/x"`` -> ``Source("parquet", "/data/x")``; ConfigError if malformed."""
        kind, sep, target = text.partition(":")
        if not sep or kind not in KINDS or not target.strip():
            raise ConfigError(
                f"bad source {text!r}: expected KIND:WHAT with KIND one of {', '.join(KINDS)} "
                "(e.g. parquet:/data/annotations, table:annotation or 'query:SELECT ...')"
            )
        return cls(kind, target.strip())

    @property
    def is_jdbc(self) -> bool:
        return self.kind in JDBC_KINDS

    def dbtable(self) -> str:
        """What JDBC's ``dbtable`` option takes: the table, or the query as a subquery."""
        if self.kind == "table":
            return self.target
        return f"({self.target}) AS drain_source"

    def __str__(self) -> str:
        return f"{self.kind}:{self.target}"


@dataclasses.dataclass(frozen=True)
class JdbcOptions:
    """How to read a ``table:`` or ``query:`` source."""

    #: Postgres URL or libpq string (or a ``jdbc:postgresql:`` URL, used as is).
    database_url: str = ""
    #: A numeric column to split the read on; None reads in one query.
    partition_column: str | None = None
    #: Parallel queries when partitioning (default: Spark's default parallelism).
    num_partitions: int | None = None
    #: Rows per round trip from Postgres.
    fetch_size: int = 10_000


@dataclasses.dataclass(frozen=True)
class JdbcConnection:
    """A JDBC URL and the properties (user, password...) it needs."""

    url: str
    properties: dict[str, str]

    def options(self) -> dict[str, str]:
        return {"url": self.url, "driver": JDBC_DRIVER, **self.properties}


def jdbc_connection(database_url: str) -> JdbcConnection:
    """The JDBC URL for a Postgres URL or libpq string.

    libpq resolves it (so ``PGHOST``, ``PGUSER``, ``.pgpass``... apply), by
    connecting once: that also reports an unreachable database early.
    """
    if database_url.startswith("jdbc:"):
        return JdbcConnection(database_url, {})
    display = mask_database_url(database_url)
    try:
        with psycopg.connect(database_url, connect_timeout=5,
                             application_name="drain spark") as conn:
            info = conn.info
            host, port, dbname, user = info.host, info.port, info.dbname, info.user
            password = info.password
            params = info.get_parameters()
    except psycopg.Error as exc:
        secrets = [p for p in (conninfo.conninfo_to_dict(database_url).get("password"),) if p]
        raise DatabaseUnavailable(
            f"database {display} unreachable: {scrub(first_line(exc), [str(s) for s in secrets])}"
        ) from None
    if host.startswith("/"):
        raise ConfigError(
            f"database {display} is reached through the Unix socket {host}, which JDBC cannot "
            "use: give a TCP host (e.g. host=127.0.0.1) for JDBC sources"
        )
    if ":" in host:  # IPv6
        host = f"[{host}]"
    properties = {"user": user}
    if password:
        properties["password"] = password
    if "sslmode" in params:
        properties["sslmode"] = params["sslmode"]
    return JdbcConnection(f"jdbc:postgresql://{host}:{port}/{dbname}", properties)


def read(spark: SparkSession, source: Source, jdbc: JdbcOptions | None = None,
         schema: str | None = None) -> DataFrame:
    """The source as a DataFrame (lazy: nothing is read until an action runs).
    ``schema`` (Spark DDL: ``"id long, n int"``) types a CSV source's columns."""
    if schema is not None and source.kind != "csv":
        raise ConfigError(f"--schema applies to csv: sources, not to {source.kind}:")
    if source.kind == "parquet":
        return _utf8_checked(spark.read.parquet(source.target))
    if source.kind == "csv":
        return _read_csv(spark, source.target, schema)
    if source.kind == "json":
        return _read_json(spark, source.target)
    return _read_jdbc(spark, source, jdbc or JdbcOptions())


def _read_json(spark: SparkSession, path: str) -> DataFrame:
    """The JSON lines, and MALFORMED for those that do not parse (when there are any:
    Spark adds the corrupt-record column to the schema it infers only then)."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    df = spark.read.json(path, mode="PERMISSIVE", columnNameOfCorruptRecord=_JSON_LINE)
    if _JSON_LINE not in df.columns:
        return df
    line = F.col(_JSON_LINE)
    why = F.when(line.isNotNull(), F.concat(
        F.lit("malformed JSON line in "), F.col("_metadata.file_path"), F.lit(": "),
        F.substring(F.rtrim(line), 1, 100)))
    return df.select(*[F.col(f"`{c}`") for c in df.columns if c != _JSON_LINE],
                     why.alias(MALFORMED))


def _utf8_checked(df: DataFrame) -> DataFrame:
    """``df`` with MALFORMED naming the first column holding a string that is not
    valid UTF-8 (a Parquet writer may store any bytes as a string); ``df`` as it is
    when it has no string."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    checks = [F.when(_invalid_utf8(F.col(f"`{field.name}`"), field.dataType), F.lit(
                  f"malformed Parquet record: invalid UTF-8 in column {field.name}"))
              for field in df.schema.fields if _holds_string(field.dataType)]
    return df.withColumn(MALFORMED, F.coalesce(*checks)) if checks else df


def _holds_string(data_type: Any) -> bool:
    """Whether a value of ``data_type`` holds a string, at any depth."""
    from pyspark.sql import types as T  # noqa: PLC0415

    if isinstance(data_type, T.StringType):
        return True
    if isinstance(data_type, T.StructType):
        return any(_holds_string(f.dataType) for f in data_type.fields)
    if isinstance(data_type, T.ArrayType):
        return _holds_string(data_type.elementType)
    if isinstance(data_type, T.MapType):
        return _holds_string(data_type.keyType) or _holds_string(data_type.valueType)
    return False


def _invalid_utf8(value: Column, data_type: Any) -> Column:
    """True when a string in ``value`` (at any depth) is not valid UTF-8; for a
    ``data_type`` that :func:`_holds_string`."""
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql import types as T  # noqa: PLC0415

    if isinstance(data_type, T.StringType):
        return ~F.is_valid_utf8(value)
    if isinstance(data_type, T.StructType):
        checks = [_invalid_utf8(value.getField(f.name), f.dataType) for f in data_type.fields
                  if _holds_string(f.dataType)]
    elif isinstance(data_type, T.ArrayType):
        checks = [_any_invalid_utf8(value, data_type.elementType)]
    else:  # a map
        checks = [_any_invalid_utf8(items, of) for items, of in (
            (F.map_keys(value), data_type.keyType), (F.map_values(value), data_type.valueType))
            if _holds_string(of)]
    return functools.reduce(operator.or_, checks)


def _any_invalid_utf8(items: Column, element_type: Any) -> Column:
    """True when an element of the array ``items`` holds a string that is not UTF-8."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    return F.exists(items, lambda item: _invalid_utf8(item, element_type))


def _read_csv(spark: SparkSession, path: str, schema: str | None) -> DataFrame:
    """The CSV file(s) with their columns typed, and MALFORMED: NULL, or why the row
    cannot be a record (a short or long row, a value its column's type cannot hold)."""
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql import types as T  # noqa: PLC0415

    names = spark.read.csv(path, header=True).columns
    if schema is not None:
        from pyspark.errors import ParseException  # noqa: PLC0415

        try:
            parsed = T.StructType.fromDDL(schema)
        except ParseException as exc:
            raise ConfigError(f"bad --schema {schema!r}: {first_line(exc)}") from None
        if not isinstance(parsed, T.StructType):
            raise ConfigError(f"bad --schema {schema!r}: expected 'NAME TYPE, ...'")
        types = parsed
        if len(types.fields) != len(names):
            raise ConfigError(f"--schema gives {len(types.fields)} column(s), the CSV header "
                              f"{len(names)} ({', '.join(names)})")
    else:
        types = _infer_csv(spark, path, names)
    # Every field a string, so that no value is lost to a type; the line of a row with
    # too few or too many fields in _CORRUPT. Its fields are counted only when the parser
    # reads every column, not just those a query needs.
    spark.conf.set("spark.sql.csv.parser.columnPruning.enabled", "false")
    text = T.StructType([T.StructField(n, T.StringType()) for n in names]
                        + [T.StructField(_CORRUPT, T.StringType())])
    raw = spark.read.csv(path, header=True, schema=text, mode="PERMISSIVE",
                         columnNameOfCorruptRecord=_CORRUPT)
    typed: list[Column] = []
    why = [F.when(F.col(_CORRUPT).isNotNull(),
                  F.lit("malformed CSV row: too few or too many fields"))]
    for name, field in zip(names, types.fields, strict=True):
        value = F.col(f"`{name}`")
        if isinstance(field.dataType, T.StringType):
            typed.append(value.alias(field.name))
            continue
        cast = value.try_cast(field.dataType)
        typed.append(cast.alias(field.name))
        why.append(F.when(value.isNotNull() & cast.isNull(), F.concat(
            F.lit("malformed CSV row: "), F.to_json(F.struct(F.substring(value, 1, 100).alias(
                field.name))),
            F.lit(f" is not a {field.dataType.simpleString()}"))))
    return raw.select(*typed, F.coalesce(*why).alias(MALFORMED))


def _infer_csv(spark: SparkSession, path: str, names: list[str]) -> StructType:
    """Spark's inferred schema, except for a column it makes a string although more
    than half its non-empty values are of one of _RESCUED_TYPES (the narrowest)."""
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql import types as T  # noqa: PLC0415

    inferred = spark.read.csv(path, header=True, inferSchema=True).schema
    strings = [i for i, f in enumerate(inferred.fields) if isinstance(f.dataType, T.StringType)]
    if not strings:
        return inferred
    raw = spark.read.csv(path, header=True)
    counts = []
    for i in strings:
        value = F.col(f"`{raw.columns[i]}`")
        counts.append(F.count(value))
        counts += [F.count_if(value.try_cast(t).isNotNull()) for t in _RESCUED_TYPES]
    row = raw.agg(*counts).collect()[0]
    fields = list(inferred.fields)
    width = 1 + len(_RESCUED_TYPES)
    for n, i in enumerate(strings):
        total, *fits = row[n * width:(n + 1) * width]
        chosen = next((t for t, fit in zip(_RESCUED_TYPES, fits, strict=True)
                       if total and fit * 2 > total), None)
        if chosen is not None:
            rescued = {"int": T.IntegerType(), "bigint": T.LongType(),
                       "double": T.DoubleType(), "boolean": T.BooleanType()}[chosen]
            fields[i] = T.StructField(names[i], rescued)
    return T.StructType(fields)


def _read_jdbc(spark: SparkSession, source: Source, options: JdbcOptions) -> DataFrame:
    connection = jdbc_connection(options.database_url)
    reader = spark.read.format("jdbc").options(
        **connection.options(), dbtable=source.dbtable(), fetchsize=str(options.fetch_size)
    )
    if options.partition_column:
        bounds = _bounds(options.database_url, source, options.partition_column)
        if bounds is not None:
            lower, upper = bounds
            partitions = options.num_partitions or spark.sparkContext.defaultParallelism
            reader = reader.options(
                partitionColumn=options.partition_column,
                lowerBound=str(lower),
                upperBound=str(upper),
                numPartitions=str(max(1, partitions)),
            )
    return reader.load()


def _bounds(database_url: str, source: Source, column: str) -> tuple[Any, Any] | None:
    """``(min, max)`` of the partition column; None when the source is empty."""
    if database_url.startswith("jdbc:"):
        raise ConfigError(
            "--partition-column needs a Postgres URL (not a jdbc: URL) to find the column's range"
        )
    # The source is the user's own table name or query: it is SQL by definition.
    statement = psql.SQL("SELECT min({col}), max({col}) FROM {src}").format(
        col=psql.Identifier(column), src=psql.SQL(source.dbtable())
    )
    try:
        with psycopg.connect(database_url, connect_timeout=5,
                             application_name="drain spark") as conn:
            row = conn.execute(statement).fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn,
            psycopg.errors.SyntaxError) as exc:
        raise ConfigError(f"source {source}: {first_line(exc)}") from None
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"database {mask_database_url(database_url)}: {first_line(exc)}"
        ) from None
    if row is None or row[0] is None:
        return None
    lower, upper = row
    if isinstance(lower, bool) or not isinstance(lower, (int, float)):
        raise ConfigError(
            f"--partition-column {column} must be numeric to split the read "
            f"(it holds {type(lower).__name__} values)"
        )
    return lower, upper
