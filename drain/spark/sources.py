"""Where the records come from: files (Parquet, CSV, JSON) or Postgres over JDBC.

A source is written ``KIND:WHAT`` on the command line:

* ``parquet:PATH``, ``csv:PATH`` (with a header line), ``json:PATH`` (JSON
  lines): a file, a directory or a glob, on any filesystem Spark reads
  (``s3a://``, ``hdfs://``...).
* ``table:NAME`` (``schema.name`` works) or ``query:SELECT ...``: read from
  Postgres over JDBC, in parallel when a numeric partition column is given
  (Spark splits ``[min, max]`` of that column into ranges, one query each).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import conninfo
from psycopg import sql as psql

from drain.errors import ConfigError, DatabaseUnavailable
from drain.spark.session import JDBC_DRIVER
from drain.url_parts import first_line
from drain.urls import mask_database_url, scrub

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

FILE_KINDS = ("parquet", "csv", "json")
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


def read(spark: SparkSession, source: Source, jdbc: JdbcOptions | None = None) -> DataFrame:
    """The source as a DataFrame (lazy: nothing is read until an action runs)."""
    if source.kind == "parquet":
        return spark.read.parquet(source.target)
    if source.kind == "csv":
        return spark.read.csv(source.target, header=True, inferSchema=True)
    if source.kind == "json":
        return spark.read.json(source.target)
    return _read_jdbc(spark, source, jdbc or JdbcOptions())


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
