"""Fixtures for the Spark tests: one local SparkSession for the whole session.

``local[2,4]``: two cores, and a failed task is retried up to 4 times, as on a
cluster (plain ``local[2]`` never retries), so that injected failures exercise
Spark's own retries. The Postgres JDBC driver is put on the classpath when
Debian's libpostgresql-jdbc-java is installed; the JDBC tests skip, saying so,
when it is not (``bash deploy/ensure-services.sh`` installs it).
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_HERE = os.path.dirname(__file__)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """pyspark warns at import that it has not certified the installed pandas."""
    for item in items:
        if str(item.fspath).startswith(_HERE):
            item.add_marker(pytest.mark.filterwarnings(
                "ignore:PySpark does not yet fully support pandas:FutureWarning"
            ))


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """A local[2,4] session, with the JDBC jar when it is installed."""
    pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[dev]'")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime (java) on PATH: Spark needs Java 17+")
    from pyspark.sql import SparkSession

    from drain.spark import session

    os.environ["PYSPARK_PYTHON"] = sys.executable
    builder = (
        SparkSession.builder.master("local[2,4]")
        .appName("drain-tests")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "2")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
    )
    jar = session.jdbc_jar()
    if jar is not None:
        builder = builder.config("spark.jars", str(jar))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    yield spark
    spark.stop()


@pytest.fixture
def jdbc(spark: SparkSession) -> None:
    """Skip unless the Postgres JDBC driver is on the session's classpath."""
    from drain.spark import session

    jar = session.jdbc_jar()
    if jar is None or not jar.is_file():
        pytest.skip(
            f"Postgres JDBC driver missing ({session.DEBIAN_JDBC_JAR}): apt-get install "
            "libpostgresql-jdbc-java, or set DRAIN_SPARK_JDBC_JAR"
        )
