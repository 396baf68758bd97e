"""The services of one test run: a Postgres cluster created for it, a RabbitMQ vhost of its own.

A pytest plugin, loaded before any conftest (``-p tests.services`` in
pyproject.toml's addopts), so that every module of the tests reads the run's
addresses from the environment when it is first imported:

* ``DRAIN_TEST_ADMIN_URL``: unless it is set already (a server of your own, or
  an xdist worker inheriting its controller's), ``initdb`` makes a new cluster
  in a temporary directory and starts it on a free port of 127.0.0.1
  (tests/pg_server.py), superuser ``postgres``, trust authentication. No test
  then leans on what an earlier run left in a server: the roles ``drain
  migrate`` creates, databases, settings. It is stopped and removed when the
  run ends.
* ``DRAIN_TEST_BROKER_URL``: unless set already, a vhost of the machine's
  RabbitMQ made for the run (``rabbitmqctl add_vhost``, guest may do anything
  there) and deleted at the end, with every queue and exchange a test left in it.

The cluster is set up as the machine's server is (autovacuum off: tests count
dead tuples), but without fsync: it is thrown away, and no test crashes it (the
failover tests crash clusters of their own, tests/replication.py).

What a run killed before its end leaves (a cluster's directory and server, a
vhost) is removed by the next run: both are named after the pytest process,
and one whose process is gone is stale. A run of tests/unit alone needs no
services and starts none.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import machine, pg_server

#: The run's cluster and vhost are named after this (and the pid of the run).
PREFIX = "drain_tests"
#: The machine's RabbitMQ, in whose new vhost the run's queues live.
BROKER_BASE = os.environ.get("DRAIN_TEST_BROKER_BASE", "amqp://guest:guest@127.0.0.1:5672")
#: The run's cluster, as the machine's server is set up, less fsync (module docstring).
SETTINGS = (
    "fsync = off", "full_page_writes = off", "autovacuum = off",
    "max_connections = 200", "shared_buffers = 128MB",
    "timezone = 'Etc/UTC'", "log_timezone = 'Etc/UTC'", "lc_messages = 'C'",
    "log_line_prefix = '%m [%p] %q%u@%d '",
)

_TESTS = Path(__file__).resolve().parent
#: The cluster's data directory in the run's directory.
DATA = "main"


def pytest_load_initial_conftests(early_config: pytest.Config, parser: Any,
                                  args: list[str]) -> None:
    if _unit_only(args):
        return
    if not os.environ.get("DRAIN_TEST_ADMIN_URL"):
        started = time.monotonic()
        cluster = Cluster.create()
        early_config.add_cleanup(cluster.remove)
        os.environ["DRAIN_TEST_ADMIN_URL"] = cluster.server.url()
        print(f"[services] a Postgres cluster for this run on 127.0.0.1:{cluster.server.port} "
              f"({cluster.root}), ready in {time.monotonic() - started:.1f}s", flush=True)
    if not os.environ.get("DRAIN_TEST_BROKER_URL"):
        vhost = Vhost.create()
        early_config.add_cleanup(vhost.remove)
        os.environ["DRAIN_TEST_BROKER_URL"] = vhost.url


def pytest_report_header() -> list[str]:
    return [f"services: Postgres {os.environ.get('DRAIN_TEST_ADMIN_URL', '(none)')}, "
            f"RabbitMQ {os.environ.get('DRAIN_TEST_BROKER_URL', '(none)')} (tests/services.py)"]


def _unit_only(args: list[str]) -> bool:
    """The command line names test paths, all of them under tests/unit."""
    paths = [Path(a.split("::")[0]) for a in args if not a.startswith("-")]
    paths = [p.resolve() for p in paths if p.exists()]
    return bool(paths) and all(p.is_relative_to(_TESTS / "unit") for p in paths)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def own_cluster() -> Iterator[pg_server.Server]:
    """A Postgres cluster of the caller's own, made as the run's is, and removed
    afterwards: for tests whose roles must not meet the run's other databases'
    (roles belong to a whole cluster)."""
    made = Cluster.create()
    try:
        yield made.server
    finally:
        made.remove()


class Cluster:
    """The run's Postgres cluster: ``<tmp>/drain_tests_<pid>_<hex>/main``."""

    def __init__(self, root: Path, port: int) -> None:
        self.root = root
        self.server = pg_server.Server(DATA, root, port)

    @classmethod
    def create(cls) -> Cluster:
        cls.remove_stale()
        root = Path(tempfile.mkdtemp(prefix=f"{PREFIX}_{os.getpid()}_",
                                     dir=tempfile.gettempdir()))
        pg_server.make_root(root)
        cluster = cls(root, machine.free_port())
        try:
            pg_server.initdb(cluster.server.data, *SETTINGS)
            cluster.start()
        except BaseException:
            cluster.remove()
            raise
        return cluster

    def start(self) -> None:
        """Start the server, on another free port if its port was taken meanwhile."""
        for _ in range(5):
            try:
                self.server.start()
            except RuntimeError:
                if "could not bind" not in self.server.log_tail():
                    raise
                self.server.port = machine.free_port()
            else:
                return
        raise RuntimeError(f"no free port for the run's Postgres: {self.server.log_tail()}")

    def remove(self) -> None:
        self.server.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    @classmethod
    def remove_stale(cls) -> None:
        """Clusters of runs whose pytest process is gone: their server stopped, removed."""
        for root in Path(tempfile.gettempdir()).glob(f"{PREFIX}_*_*"):
            match = re.fullmatch(rf"{PREFIX}_(\d+)_\w+", root.name)
            if not match or _alive(int(match.group(1))) or not root.is_dir():
                continue
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int((root / DATA / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)  # immediate: it is thrown away
            shutil.rmtree(root, ignore_errors=True)


class Vhost:
    """The run's RabbitMQ vhost: ``drain_tests_<pid>_<hex>``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = f"{BROKER_BASE}/{name}"

    @classmethod
    def create(cls) -> Vhost:
        if shutil.which("rabbitmqctl") is None:
            raise RuntimeError("rabbitmqctl not found: the tests make a RabbitMQ vhost of "
                               "their own (or set DRAIN_TEST_BROKER_URL to one)")
        names = machine.rabbitmqctl("list_vhosts", "name").split()
        for name in names:  # left by runs whose pytest process is gone
            match = re.fullmatch(rf"{PREFIX}_(\d+)_\w+", name)
            if match and not _alive(int(match.group(1))):
                with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                    # A run killed mid-test may have left a queue process suspended
                    # (tests/integration/test_slow_queue.py): it would hold the delete
                    # forever. Resuming one that is not suspended does nothing.
                    machine.rabbitmqctl(
                        "eval", "[catch sys:resume(amqqueue:get_pid(Q), 2000) || Q <- "
                        f'rabbit_amqqueue:list(<<"{name}">>)].')
                    machine.rabbitmqctl("delete_vhost", name)
        vhost = cls(f"{PREFIX}_{os.getpid()}_{uuid.uuid4().hex[:8]}")
        machine.rabbitmqctl("add_vhost", vhost.name)
        try:
            machine.rabbitmqctl("set_permissions", "-p", vhost.name, "guest", ".*", ".*", ".*")
        except BaseException:
            vhost.remove()
            raise
        return vhost

    def remove(self) -> None:
        with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
            machine.rabbitmqctl("delete_vhost", self.name)
