"""pyspark's and the executors' exceptions as drain's: one line, naming the cause.

A task's exception reaches the driver wrapped in Spark's (a Py4J error around
a SparkException around the Python worker's traceback); :func:`describe` digs
out the cause: drain's own errors (a partition that Postgres refused names the
partition and the COPY line), Postgres' over JDBC, or the last Python
exception of the traceback.

Two failures are not a task's, and are told apart first:

* Postgres closing a partition's connection (terminated, restarted, shut down)
  is the database unavailable (exit 3), not a refusal of the partition's jobs;
* the JVM that runs Spark for this driver dying (killed, out of memory) shows
  in Python as a socket error of py4j's (``ConnectionRefusedError``, a
  ``Py4JNetworkError``): :class:`SparkJvmLost`, one line naming the JVM, and
  py4j's own logged tracebacks are silenced (``-v`` shows them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import traceback
from collections.abc import Iterator

from drain.errors import (
    ConfigError,
    DatabaseUnavailable,
    DrainError,
    PartitioningChanged,
    UsageError,
)
from drain.spark import writer

_PY_ERROR = re.compile(
    r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Violation|Fault)|PartitioningChanged): (.+)$",
    re.MULTILINE
)
_UNREACHABLE = re.compile(
    r"Connection to \S+ refused|connection attempt failed|password authentication failed|"
    r"could not connect|Connection refused|OperationalError",
)
#: A value ANSI mode cannot cast: Spark's message ends with advice (try_cast) for its
#: SQL users; drain's user gets the value, the types and what to do instead.
_CAST_INVALID = re.compile(
    r"\[CAST_INVALID_INPUT\] The value (.+?) of the type \"?([^\"]+?)\"? cannot be cast to "
    r"\"?([^\"]+?)\"? because"
)

#: What to do after a partition lost its database connection or the driver its JVM.
_RERUN = ("re-run with the same --id to stage the partitions that did not commit (those "
          "that did are skipped)")
_PY4J_DIR = f"{os.sep}py4j{os.sep}"


class SparkJvmLost(DrainError):
    """The JVM running Spark for this driver exited or stopped answering (exit 1)."""


class _Py4JRootRecords(logging.Filter):
    """py4j logs its socket errors on the root logger (``logging.info(...,
    exc_info=True)``), each with a traceback; drain reports their outcome in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _PY4J_DIR not in record.pathname


_PY4J_ROOT_RECORDS = _Py4JRootRecords()


def quiet_py4j(verbose: bool) -> None:
    """Silence py4j's logging (its own loggers, and its records on the root logger)
    unless ``verbose``."""
    logging.getLogger("py4j").setLevel(logging.WARNING if verbose else logging.CRITICAL)
    if verbose:
        logging.getLogger().removeFilter(_PY4J_ROOT_RECORDS)
    else:
        logging.getLogger().addFilter(_PY4J_ROOT_RECORDS)


def jvm_lost(exc: BaseException) -> bool:
    """True when ``exc`` is py4j failing to reach the JVM at all (its socket refused,
    reset or closed), which only happens once that JVM has died or hung."""
    name = type(exc).__name__
    if name == "Py4JNetworkError" or (
        name == "Py4JError" and "while sending or receiving" in str(exc)
    ):
        return True
    if isinstance(exc, (ConnectionError, EOFError)):
        return any(_PY4J_DIR in frame.filename for frame in traceback.extract_tb(exc.__traceback__))
    return False


def lost_jvm() -> SparkJvmLost:
    return SparkJvmLost(
        "lost the Spark JVM: the Java process running Spark for this command exited or "
        "stopped answering (killed? out of memory? see its log, or rerun with -v); "
        f"{_RERUN}"
    )


@contextlib.contextmanager
def spark_errors() -> Iterator[None]:
    """Turn pyspark's and the executors' exceptions into drain's (one line, exit code)."""
    try:
        yield
    except DrainError:
        raise
    except Exception as exc:
        if jvm_lost(exc):
            raise lost_jvm() from exc
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
        return UsageError(f"Postgres refused a Spark read: {message}")
    raised = re.search(r"\[USER_RAISED_EXCEPTION\] (.+?)(?: SQLSTATE: \w+|$)", text, re.MULTILINE)
    if raised:  # raise_error() in drain's own expressions: a NULL key, args...
        return UsageError(raised.group(1).strip())
    cast = _CAST_INVALID.search(text)
    if cast:  # Spark's advice (try_cast) is for SQL its user writes, not for drain's
        value, source_type, target_type = cast.groups()
        return UsageError(
            f"Spark cannot read the value {value} ({source_type.lower()}) as "
            f"{target_type.lower()}: correct it in the data, or convert the column yourself "
            "(a query: source; try_cast in --where or an -expr flag)"
        )
    if type(exc).__name__ in ("AnalysisException", "ParseException"):
        return UsageError(f"Spark: {_first_line(text)}")
    found = [m for m in _PY_ERROR.finditer(text) if not m.group(1).startswith("Py4J")]
    for match in reversed(found):
        name, message = match.group(1), match.group(2).strip()
        if name in ("PythonException", "SparkException"):
            continue
        if name == PartitioningChanged.__name__:  # a partition's claim refused it: exit 6
            return PartitioningChanged(message)
        if name == writer.ConnectionLostError.__name__:
            return DatabaseUnavailable(f"{message}; {_RERUN}")
        if _UNREACHABLE.search(name + " " + message):
            return DatabaseUnavailable(f"a Spark task could not reach the database: {message}")
        return DrainError(f"a Spark task failed: {name}: {message}")
    return DrainError(f"Spark failed: {_first_line(text)}")


def _first_line(text: str) -> str:
    stripped = text.strip()
    line = stripped.splitlines()[0] if stripped else "unknown error"
    return re.sub(r"\s*SQLSTATE: \w+;?$", "", line)
