"""The SparkSession drain's Spark commands run on.

Locally (the default) the session is ``local[*]``: no cluster, nothing to
install but ``pip install 'drain-outbox[spark]'`` and a Java runtime. Executors run the
interpreter that runs drain (``PYSPARK_PYTHON`` defaults to it), and Debian's
Postgres JDBC driver (``/usr/share/java/postgresql.jar``, package
``libpostgresql-jdbc-java``) is put on the classpath when it is there.

A local session runs 4 shuffle partitions per core instead of Spark's 200.

Under ``spark-submit`` (``PYSPARK_GATEWAY_PORT`` is set) drain changes nothing:
the master, ``--jars`` and ``PYSPARK_PYTHON`` are whatever the submit gave.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from drain.errors import ConfigError
from drain.version import DISTRIBUTION

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

DEFAULT_MASTER = "local[*]"
DEBIAN_JDBC_JAR = Path("/usr/share/java/postgresql.jar")
JDBC_DRIVER = "org.postgresql.Driver"


def jdbc_jar() -> Path | None:
    """The Postgres JDBC jar to put on a local session's classpath, if any.

    ``DRAIN_SPARK_JDBC_JAR`` names it; otherwise Debian's package's jar.
    """
    named = os.environ.get("DRAIN_SPARK_JDBC_JAR")
    if named:
        return Path(named)
    return DEBIAN_JDBC_JAR if DEBIAN_JDBC_JAR.is_file() else None


def under_spark_submit() -> bool:
    """True when spark-submit launched this interpreter (it owns the configuration)."""
    return "PYSPARK_GATEWAY_PORT" in os.environ


def get_session(master: str | None, app_name: str,
                verbose: bool = False) -> tuple[SparkSession, bool]:
    """The active SparkSession, or a new one; ``(session, created_here)``.

    ``master`` is ``--master`` / ``DRAIN_SPARK_MASTER``; ``None`` means
    ``local[*]``, except under spark-submit, whose master is kept. A session created
    here logs only FATAL lines (ERROR with ``verbose``): a failed task's stack trace
    would come before drain's one line saying what failed (drain.spark.errors).
    """
    try:
        from pyspark.sql import SparkSession  # noqa: PLC0415 - pyspark is optional
    except ModuleNotFoundError as exc:
        if exc.name != "pyspark":
            raise
        raise ConfigError(
            f"pyspark is not installed: pip install '{DISTRIBUTION}[spark]' (Spark also "
            "needs a Java 17+ runtime; see docs/spark.md)"
        ) from None

    active = SparkSession.getActiveSession()
    if active is not None:
        return active, False
    builder = SparkSession.builder.appName(app_name)
    if master or not under_spark_submit():
        master = master or DEFAULT_MASTER
        builder = builder.master(master)
        if master.startswith("local"):
            # Executors are this process's children: let them import drain.
            os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
            jar = jdbc_jar()
            if jar is not None:
                builder = builder.config("spark.jars", str(jar))
            builder = builder.config("spark.ui.enabled", "false")
            # Spark's 200 shuffle partitions are 200 tasks per join or aggregation
            # (drain reconcile): on one machine, 4 per core do the same work faster.
            builder = builder.config("spark.sql.shuffle.partitions",
                                     str(4 * local_cores(master)))
    # drain draws its own progress bar (drain.spark.progress), in partitions.
    builder = builder.config("spark.ui.showConsoleProgress", "false")
    session = builder.getOrCreate()
    session.sparkContext.setLogLevel("ERROR" if verbose else "FATAL")
    return session, True


def local_cores(master: str) -> int:
    """The cores of a ``local``, ``local[N]``, ``local[*]`` or ``local[N,F]`` master."""
    inside = master.partition("[")[2].partition("]")[0].split(",")[0].strip()
    if inside.isdigit() and int(inside) > 0:
        return int(inside)
    return 1 if not inside else (os.cpu_count() or 1)


def is_local(session: SparkSession) -> bool:
    """True when the session runs in local mode."""
    return str(session.sparkContext.master).startswith("local")
