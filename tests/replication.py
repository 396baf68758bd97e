"""A throwaway streaming-replication pair of Postgres clusters, for the failover tests.

The run's own cluster (the one every other test uses) is never touched:
:func:`replicated_pair` runs ``initdb`` into a fresh directory, starts that
primary on a free port (127.0.0.1 and a Unix socket in the same directory, trust
authentication, replication included), creates a database with the drain's
schema and the test application's table, makes a replica of it with
``pg_basebackup -R -X stream`` and starts it on another free port. It yields
once the replica streams, and in every case stops both servers (immediate
shutdown) and removes the directory on the way out.

The servers are tests/pg_server.py's. Readiness is polled against a deadline
(``pg_ctl -w``, then a query): no sleeps.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from drain.postgres import migration
from tests import roles, support
from tests.pg_server import Server, initdb, make_root, run

#: The database the pair serves (created on the primary before the replica is made).
DBNAME = "drain_failover"
#: What the application of the failover test writes with each job it stages: the
#: rows a database kept are exactly the commits it still has.
APP_DDL = "CREATE TABLE produced (task_id uuid PRIMARY KEY, n bigint NOT NULL)"


class Pair:
    """A primary and its streaming replica."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.primary = Server("primary", root, support.free_port(), DBNAME)
        self.replica = Server("replica", root, support.free_port(), DBNAME)

    def both_url(self, **params: str) -> str:
        """A libpq multi-host URL naming both servers, primary first."""
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return (f"postgresql://postgres@127.0.0.1:{self.primary.port},"
                f"127.0.0.1:{self.replica.port}/{DBNAME}" + (f"?{query}" if query else ""))

    def streaming(self) -> bool:
        with psycopg.connect(self.primary.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT count(*) FROM pg_stat_replication "
                               "WHERE state = 'streaming'").fetchone()
            return bool(row and row[0])

    def caught_up(self) -> bool:
        """The replica has replayed everything the primary has written so far."""
        with psycopg.connect(self.primary.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()").fetchone()
            assert row is not None
            target = row[0]
        with psycopg.connect(self.replica.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn",
                               (target,)).fetchone()
            return bool(row and row[0])

    def replayed_all_received(self) -> bool:
        """The replica (its primary gone) has replayed all the WAL it received."""
        with psycopg.connect(self.replica.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_last_wal_replay_lsn() >= pg_last_wal_receive_lsn()"
                               ).fetchone()
            return bool(row and row[0])

    def logs(self) -> str:
        return "\n".join(f"--- {s.name} log ---\n{s.log_tail()}"
                         for s in (self.primary, self.replica))

    def setup(self) -> None:
        # Throwaway clusters: a small footprint, and no fsync (an immediate
        # shutdown is not an OS crash: the page cache keeps what was written).
        initdb(self.primary.data, "fsync = off", "shared_buffers = 16MB", "max_connections = 40",
               "wal_level = replica", "max_wal_senders = 4", "hot_standby = on",
               "wal_receiver_status_interval = 1s", "log_connections = on")
        self.primary.start()
        with psycopg.connect(self.primary.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DBNAME}")
        with psycopg.connect(self.primary.url(DBNAME)) as conn:
            migration.migrate(conn)
            conn.execute(APP_DDL)
        roles.ensure(self.primary.url(DBNAME))  # the drains run as its runner role
        run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
             "-D", str(self.replica.data), "-R", "-X", "stream", "--no-sync",
             "-c", "fast")
        self.replica.start()
        support.wait_for(self.streaming, 30, "the replica to stream from the primary")


@contextlib.contextmanager
def replicated_pair() -> Iterator[Pair]:
    """A running primary/replica pair; both stopped and their directory removed after."""
    root = make_root(Path(tempfile.mkdtemp(prefix="drain-pg-")))
    pair = Pair(root)
    started = time.monotonic()
    try:
        pair.setup()
        print(f"\n[replication] primary :{pair.primary.port} and streaming replica "
              f":{pair.replica.port} ready in {time.monotonic() - started:.1f}s")
        yield pair
    finally:
        for server in (pair.primary, pair.replica):
            server.kill()
        shutil.rmtree(root, ignore_errors=True)
