"""A Postgres server the tests start themselves: initdb, start, stop, kill.

Used for the run's own cluster (tests/services.py) and for the failover tests'
primary and replica (tests/replication.py). Postgres refuses to run as root:
when the tests run as root, every server binary runs as ``postgres``
(``runuser``) and the directory belongs to it. Readiness is polled against a
deadline (``pg_ctl -w``): no sleeps.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import signal
import subprocess
from pathlib import Path

import psycopg

#: The server binaries: DRAIN_TEST_PG_BIN, else Debian's for Postgres 15 (the version
#: the machine's own server runs), else the newest Debian has.
PG_BIN = Path(os.environ.get("DRAIN_TEST_PG_BIN") or next(
    (str(d) for d in [Path("/usr/lib/postgresql/15/bin"),
                      *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]
     if (d / "initdb").exists()), "/usr/lib/postgresql/15/bin"))
#: Seconds for a server to start, stop or be promoted.
SERVER_TIMEOUT = 60


def server_user() -> str | None:
    """``postgres`` when running as root (Postgres refuses root), else None (ourselves)."""
    return "postgres" if os.geteuid() == 0 else None


def run(*argv: str, timeout: float = SERVER_TIMEOUT) -> str:
    """Run a Postgres binary (as ``postgres`` when we are root); its output, or raise."""
    user = server_user()
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
    """One Postgres cluster: its data directory (``root/name``), port and log."""

    def __init__(self, name: str, root: Path, port: int, dbname: str = "postgres") -> None:
        self.name = name
        #: The database :meth:`url` names unless told another.
        self.dbname = dbname
        self.root = root
        self.data = root / name
        self.port = port
        self.log = root / f"{name}.log"

    def url(self, dbname: str | None = None, **params: str) -> str:
        dbname = dbname or self.dbname
        query = "&".join(f"{k}={v}" for k, v in params.items())
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}" + (
            f"?{query}" if query else "")

    def start(self) -> None:
        """Start and wait (``pg_ctl -w``) until it accepts connections."""
        options = (f"-c port={self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={self.root}")
        run("pg_ctl", "start", "-D", str(self.data), "-l", str(self.log), "-w",
            "-t", str(SERVER_TIMEOUT), "-o", options)

    def stop(self, mode: str = "fast") -> None:
        """Stop (``fast``: clean; ``immediate``: like a crash, no shutdown checkpoint)."""
        run("pg_ctl", "stop", "-D", str(self.data), "-m", mode, "-w",
            "-t", str(SERVER_TIMEOUT))

    def promote(self) -> None:
        """Promote a replica and wait until it accepts writes."""
        run("pg_ctl", "promote", "-D", str(self.data), "-w", "-t", str(SERVER_TIMEOUT))

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


def make_root(root: Path) -> Path:
    """``root`` (a new directory) made the server user's."""
    user = server_user()
    if user is not None:
        entry = pwd.getpwnam(user)
        os.chown(root, entry.pw_uid, entry.pw_gid)
    return root


def initdb(data: Path, *settings: str) -> None:
    """A new cluster in ``data``: superuser postgres, trust authentication (TCP on
    127.0.0.1 and the socket, replication included), UTF-8; ``settings`` (lines of
    postgresql.conf) appended to its configuration."""
    if not (PG_BIN / "initdb").exists():
        raise RuntimeError(f"no initdb in {PG_BIN}: install the Postgres server package "
                           "or set DRAIN_TEST_PG_BIN to its bin directory")
    run("initdb", "-D", str(data), "-U", "postgres", "-A", "trust", "--no-sync",
        "--no-instructions", "-E", "UTF8")
    with (data / "postgresql.conf").open("a") as conf:
        conf.write("\n" + "\n".join(settings) + "\n")
