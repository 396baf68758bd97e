"""A real PgBouncer for the tests: started on a free port in front of the test Postgres.

Debian's ``pgbouncer`` package (deploy/ensure-services.sh installs it) brings
the binary; each :class:`PgBouncer` runs its own process with its own config,
auth file and log in a private temporary directory, so tests never share a
pool. PgBouncer refuses to run as root: as root it runs with ``-u postgres``
and the directory is handed to that user. The ``*`` database entry forwards any
database name (the per-test ``drain_t_*`` databases) to the same name upstream.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import psycopg
import pytest
from psycopg import conninfo

from tests import roles, support

MODES = ("session", "transaction", "statement")
#: Seconds a started PgBouncer has to answer.
START_TIMEOUT = 20.0


def binary() -> str:
    """pgbouncer's path; fails where it could be installed, skips only where it cannot."""
    found = shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/sbin")
    if found:
        return found
    why = ("no pgbouncer: deploy/ensure-services.sh installs Debian's pgbouncer package "
           "(as root, with apt-get)")
    if os.environ.get("CI") == "true" and os.geteuid() == 0 and shutil.which("apt-get"):
        pytest.fail(why + "; under CI as root it should have been installed")
    pytest.skip(why)


class PgBouncer:
    """One pgbouncer process in ``pool_mode`` forwarding to the test Postgres."""

    def __init__(self, pool_mode: str, **settings: str | int) -> None:
        assert pool_mode in MODES, pool_mode
        self.pool_mode = pool_mode
        up = conninfo.conninfo_to_dict(support.ADMIN_URL)
        self._upstream = (str(up.get("host") or "127.0.0.1"), str(up.get("port") or 5432))
        self._user = str(up.get("user") or getpass.getuser())
        self._settings = settings
        self.dir = Path(tempfile.mkdtemp(prefix="drain-pgbouncer-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.dir / "pgbouncer.log"

    def url(self, db_url: str, password: str | None = None) -> str:
        """``db_url``'s database and user, through this pool (with ``password``, which
        trust authentication never asks for)."""
        params = conninfo.conninfo_to_dict(db_url)
        user = str(params.get("user") or self._user)
        auth = f"{quote(user, safe='')}:{quote(password, safe='')}" if password else user
        return f"postgresql://{auth}@127.0.0.1:{self.port}/{params['dbname']}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self) -> PgBouncer:
        """Start it and wait until it serves a query; a port taken meanwhile is retried."""
        for _attempt in range(3):
            self.port = support.free_port()
            self._write_config()
            argv = [binary(), str(self.dir / "pgbouncer.ini")]
            if os.geteuid() == 0:
                argv[1:1] = ["-u", "postgres"]  # it refuses to run as root
            with open(self.dir / "stderr.log", "ab") as err:
                self.proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=err, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            if self._wait_until_serving():
                return self
            if "Address already in use" not in self._output():
                break
        self.stop(remove=False)
        raise AssertionError(f"pgbouncer ({self.pool_mode}) did not start:\n{self._output()}")

    def stop(self, *, remove: bool = True) -> None:
        """Terminate (kill after 10 s), then remove its directory."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()  # SIGTERM: immediate shutdown, clients cut
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if remove:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _output(self) -> str:
        err = self.dir / "stderr.log"
        return (err.read_text(errors="replace") if err.exists() else "") + self.log()

    def _wait_until_serving(self) -> bool:
        """Poll (a connection and a query through the pool) until it answers or dies."""
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT
        url = self.url(support.ADMIN_URL)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with (contextlib.suppress(psycopg.OperationalError),
                  psycopg.connect(url, connect_timeout=2, autocommit=True) as conn):
                conn.execute("SELECT 1").fetchone()
                return True
            time.sleep(0.05)
        return False

    def _write_config(self) -> None:
        host, port = self._upstream
        users = {self._user, "postgres", "root", getpass.getuser(), *roles.GRANTS}
        settings: dict[str, str | int] = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": str(self.dir / "userlist.txt"),
            "pool_mode": self.pool_mode,
            "logfile": str(self.log_path),
            "pidfile": "",
            "max_client_conn": 200,
            "default_pool_size": 20,
            # Sent by some drivers; PgBouncer would refuse the login otherwise.
            "ignore_startup_parameters": "extra_float_digits",
            **self._settings,
        }
        lines = ["[databases]", f"* = host={host} port={port}", "", "[pgbouncer]"]
        lines += [f"{key} = {value}" for key, value in settings.items()]
        (self.dir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")
        (self.dir / "userlist.txt").write_text("".join(f'"{u}" ""\n' for u in sorted(users)))
        if os.geteuid() == 0:  # readable and writable (the log) by the user it runs as
            entry = pwd.getpwnam("postgres")
            for path in (self.dir, *self.dir.iterdir()):
                os.chown(path, entry.pw_uid, entry.pw_gid)


@contextlib.contextmanager
def running(pool_mode: str, **settings: str | int) -> Iterator[PgBouncer]:
    """A started PgBouncer, stopped and removed on the way out."""
    bouncer = PgBouncer(pool_mode, **settings)
    try:
        yield bouncer.start()
    finally:
        bouncer.stop()
