"""Fixtures of the ``rabbit_cluster`` tests: one three-node cluster for the module.

The cluster (tests/rabbit_cluster/cluster.py) is started once per module and
stopped at its end; every test finds all three nodes running, clustered and
not partitioned (a test that killed, froze or cut off a node gets it back),
and its quorum queue is deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.rabbit_cluster import cluster as rabbit
from tests.rabbit_cluster.scenario import Scenario, delete_queues


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[rabbit.Cluster]:
    missing = ("no RabbitMQ server here (apt-get install rabbitmq-server)"
               if not (rabbit.RABBIT_BIN / "rabbitmq-server").exists() else
               "no iptables: the partition tests need it (apt-get install iptables; "
               "bash deploy/ensure-services.sh does it as root)"
               if shutil.which("iptables") is None else "")
    if missing and os.environ.get("CI") == "true":
        pytest.fail(missing)  # CI ran deploy/ensure-services.sh: the run would mean nothing
    if missing:
        pytest.skip(missing)
    with rabbit.running(tmp_path_factory.mktemp("rabbit-cluster")) as running:
        yield running


@pytest.fixture
def whole(cluster: rabbit.Cluster) -> Iterator[rabbit.Cluster]:
    """The cluster with all three nodes up, joined and healed, before and after."""
    cluster.restore()
    yield cluster
    cluster.restore()


@pytest.fixture
def scenario(whole: rabbit.Cluster, db_url: str, spawn: Any) -> Iterator[Scenario]:
    queue = f"cluster_{uuid.uuid4().hex[:10]}"
    run = Scenario(whole, db_url, queue, spawn)
    try:
        yield run
    finally:
        run.stop()
        whole.restore()
        delete_queues(whole, [queue, run.classic_queue])
