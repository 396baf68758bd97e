"""pyspark's and the executors' exceptions as drain's: one line, naming the cause.

A task's exception reaches the driver wrapped in Spark's (a Py4J error around
a SparkException around the Python worker's traceback); :func:`describe` digs
out the cause: drain's own errors (a partition that Postgres refused names the
partition and the COPY line), Postgres' over JDBC, or the last Python
exception of the traceback.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

from drain import cli_common
from drain.errors import ConfigError, DatabaseUnavailable, DrainError

_PY_ERROR = re.compile(
    r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Violation|Fault)): (.+)$", re.MULTILINE
)
_UNREACHABLE = re.compile(
    r"Connection to \S+ refused|connection attempt failed|password authentication failed|"
    r"could not connect|Connection refused|OperationalError",
)


@contextlib.contextmanager
def spark_errors() -> Iterator[None]:
    """Turn pyspark's and the executors' exceptions into drain's (one line, exit code)."""
    try:
        yield
    except DrainError:
        raise
    except Exception as exc:
        translated = describe(exc)
        if translated is None:
            raise
        raise translated from exc


def describe(exc: BaseException) -> DrainError | None:
    """A DrainError for an exception raised by pyspark or py4j; None for anything else."""

    module = type(exc).__module__
    if not module.startswith(("pyspark", "py4j")):
        return None
    text = str(exc)
    if "org.postgresql.Driver" in text or "No suitable driver" in text:
        return ConfigError(
            "the Postgres JDBC driver is not on Spark's classpath: install "
            "libpostgresql-jdbc-java (/usr/share/java/postgresql.jar), set DRAIN_SPARK_JDBC_JAR, "
            "or pass spark-submit --jars postgresql.jar"
        )
    psql = re.search(r"PSQLException: (.+)", text)
    if psql:
        message = psql.group(1).strip()
        if _UNREACHABLE.search(message):
            return DatabaseUnavailable(f"database unavailable to Spark: {message}")
        return cli_common.UsageError(f"Postgres refused a Spark read: {message}")
    raised = re.search(r"\[USER_RAISED_EXCEPTION\] (.+?)(?: SQLSTATE: \w+|$)", text, re.MULTILINE)
    if raised:  # raise_error() in drain's own expressions: a NULL key, args...
        return cli_common.UsageError(raised.group(1).strip())
    if type(exc).__name__ in ("AnalysisException", "ParseException"):
        return cli_common.UsageError(f"Spark: {_first_line(text)}")
    found = [m for m in _PY_ERROR.finditer(text) if not m.group(1).startswith("Py4J")]
    for match in reversed(found):
        name, message = match.group(1), match.group(2).strip()
        if name in ("PythonException", "SparkException"):
            continue
        if _UNREACHABLE.search(name + " " + message):
            return DatabaseUnavailable(f"a Spark task could not reach the database: {message}")
        return DrainError(f"a Spark task failed: {name}: {message}")
    return DrainError(f"Spark failed: {_first_line(text)}")


def _first_line(text: str) -> str:
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else "unknown error"
    return re.sub(r"\s*SQLSTATE: \w+;?$", "", line)
