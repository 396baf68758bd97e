"""docs/rabbitmq_cluster.md's commands, as written: ``up`` starts three clustered
nodes and prints their broker list, ``down`` stops them and leaves no node running."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import support
from tests.rabbit_cluster import cluster as rabbit

pytestmark = [pytest.mark.rabbit_cluster, pytest.mark.timeout(300)]


def test_up_prints_the_broker_list_and_down_stops_every_node(tmp_path: Path) -> None:
    if not (rabbit.RABBIT_BIN / "rabbitmq-server").exists():
        pytest.skip("no RabbitMQ server here (apt-get install rabbitmq-server)")
    root = tmp_path / "rabbit-cluster"
    command = [sys.executable, "-m", "tests.rabbit_cluster.cluster"]
    try:
        up = subprocess.run([*command, "up", str(root)], capture_output=True, text=True,
                            timeout=240, cwd=support.ROOT, check=False)
        assert up.returncode == 0, up.stderr
        brokers = up.stdout.strip().splitlines()[-1].split(";")
        assert brokers == [node.url for node in rabbit.Cluster(root).nodes]
        for node in rabbit.Cluster(root).nodes:
            with node.channel():
                pass  # it answers
    finally:
        down = subprocess.run([*command, "down", str(root)], capture_output=True, text=True,
                              timeout=240, cwd=support.ROOT, check=False)
    assert down.returncode == 0, down.stderr
    support.wait_for(lambda: not rabbit.node_pids(), 30, "every node to stop")
