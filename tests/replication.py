"""A throwaway streaming-replication pair of Postgres clusters, for the failover tests.

The machine's own Postgres (the one every other test uses) is never touched:
:func:`replicated_pair` runs ``initdb`` into a fresh directory, starts that
primary on a free port (127.0.0.1 and a Unix socket in the same directory, trust
authentication, replication included), creates a database with the drain's
schema and the test application's table, makes a replica of it with
``pg_basebackup -R -X stream`` and starts it on another free port. It yields
once the replica streams, and in every case stops both servers (immediate
shutdown) and removes the directory on the way out.

Postgres refuses to run as root: when the tests run as root, every server
binary runs as ``postgres`` (``runuser``) and the directory belongs to it.
Readiness is polled against a deadline (``pg_ctl -w``, then a query): no sleeps.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from drain.postgres import store
from tests import roles, support

#: The server binaries: DRAIN_TEST_PG_BIN, else Debian's for Postgres 15 (the version
#: the machine's own server runs), else the newest Debian has.
PG_BIN = Path(os.environ.get("DRAIN_TEST_PG_BIN") or next(
    (str(d) for d in [Path("/usr/lib/postgresql/15/bin"),
                      *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]
     if (d / "initdb").exists()), "/usr/lib/postgresql/15/bin"))
#: The database the pair serves (created on the primary before the replica is made).
DBNAME = "drain_failover"
#: Seconds for a server to start, stop or be promoted.
SERVER_TIMEOUT = 60
#: What the application of the failover test writes with each job it stages: the
#: rows a database kept are exactly the commits it still has.
APP_DDL = "CREATE TABLE produced (task_id uuid PRIMARY KEY, n bigint NOT NULL)"


def _server_user() -> str | None:
    """``postgres`` when running as root (Postgres refuses root), else None (ourselves)."""
    return "postgres" if os.geteuid() == 0 else None


def _run(*argv: str, timeout: float = SERVER_TIMEOUT) -> str:
    """Run a Postgres binary (as ``postgres`` when we are root); its output, or raise."""
    user = _server_user()
    command = [str(PG_BIN / argv[0]), *argv[1:]]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                          check=False, stdin=subprocess.DEVNULL, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{argv[0]} exited with {done.returncode}: "
                           f"{(done.stdout + done.stderr).strip()[-2000:]}")
    return done.stdout


class Server:
    """One Postgres cluster of the pair: its data directory, port and log."""

    def __init__(self, name: str, root: Path, port: int) -> None:
        self.name = name
        self.root = root
        self.data = root / name
        self.port = port
        self.log = root / f"{name}.log"

    def url(self, dbname: str = DBNAME, **params: str) -> str:
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}" + (
            f"?{query}" if query else "")

    def start(self) -> None:
        """Start and wait (``pg_ctl -w``) until it accepts connections."""
        options = (f"-c port={self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.root}")
        _run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w",
             "-t", str(SERVER_TIMEOUT), "-o", options)

    def stop(self, mode: str = "fast") -> None:
        """Stop (``fast``: clean; ``immediate``: like a crash, no shutdown checkpoint)."""
        _run("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w",
             "-t", str(SERVER_TIMEOUT))

    def promote(self) -> None:
        """Promote a replica and wait until it accepts writes."""
        _run("pg_ctl", "promote", "-D", str(self.data), "-w", "-t", str(SERVER_TIMEOUT))

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()

    def kill(self) -> None:
        """Teardown: stop it however it can be stopped."""
        if not self.running():
            return
        try:
            self.stop("immediate")
        except (RuntimeError, subprocess.TimeoutExpired):
            with contextlib.suppress(OSError, ValueError, IndexError):
                pid = int((self.data / "postmaster.pid").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)

    def in_recovery(self) -> bool:
        with psycopg.connect(self.url(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            return bool(row and row[0])

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-chars:]
        return ""


class Pair:
    """A primary and its streaming replica."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.primary = Server("primary", root, support.free_port())
        self.replica = Server("replica", root, support.free_port())

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
        _run("initdb", "-D", str(self.primary.data), "-U", "postgres", "-A", "trust",
             "--no-sync", "--no-instructions", "-E", "UTF8")
        # Throwaway clusters: a small footprint, and no fsync (an immediate
        # shutdown is not an OS crash: the page cache keeps what was written).
        with (self.primary.data / "postgresql.conf").open("a") as conf:
            conf.write("\nfsync = off\nshared_buffers = 16MB\nmax_connections = 40\n"
                       "wal_level = replica\nmax_wal_senders = 4\nhot_standby = on\n"
                       "wal_receiver_status_interval = 1s\nlog_connections = on\n")
        self.primary.start()
        with psycopg.connect(self.primary.url("postgres"), autocommit=True) as admin:
            admin.execute(f"CREATE DATABASE {DBNAME}")
        with psycopg.connect(self.primary.url()) as conn:
            store.migrate(conn)
            conn.execute(APP_DDL)
        roles.ensure(self.primary.url("postgres"))  # the drains run as drain_runner
        _run("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "postgres",
             "-D", str(self.replica.data), "-R", "-X", "stream", "--no-sync",
             "-c", "fast")
        self.replica.start()
        support.wait_for(self.streaming, 30, "the replica to stream from the primary")


@contextlib.contextmanager
def replicated_pair() -> Iterator[Pair]:
    """A running primary/replica pair; both stopped and their directory removed after."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"no initdb in {PG_BIN}: install the Postgres server package "
                           "or set DRAIN_TEST_PG_BIN to its bin directory")
    root = Path(tempfile.mkdtemp(prefix="drain-pg-"))
    user = _server_user()
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
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
