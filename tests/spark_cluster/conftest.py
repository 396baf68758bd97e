"""Fixtures for the ``spark_cluster`` tests: one standalone cluster per module.

A master and two workers (1 core, 1 GiB each) from pyspark's ``spark-class``
on free ports (:mod:`tests.spark_cluster.standalone`); every test finds both
workers alive (a test that killed one gets it back), and the cluster's JVMs
are stopped, with whatever they started, at the end of the module.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.spark_cluster import standalone


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[standalone.Cluster]:
    pytest.importorskip("pyspark", reason="pyspark is not installed: pip install -e '.[dev]'")
    if shutil.which("java") is None:
        pytest.skip("no Java runtime (java) on PATH: Spark needs Java 17+")
    from drain.spark import session

    if session.jdbc_jar() is None:
        pytest.skip("Postgres JDBC driver missing: apt-get install libpostgresql-jdbc-java")
    with standalone.running(tmp_path_factory.mktemp("spark-cluster")) as running:
        yield running


@pytest.fixture
def workers(cluster: standalone.Cluster) -> standalone.Cluster:
    """The cluster, with both workers alive (restarted if an earlier test killed one)."""
    for index, worker in enumerate(cluster.workers):
        if not worker.alive():
            cluster.restart_worker(index)
    cluster.wait_for_workers(len(cluster.workers))
    return cluster


@pytest.fixture
def bundle_dir(tmp_path: Path) -> Path:
    return tmp_path / "bundle"
