"""Helpers shared by the integration and acceptance tests.

Every test gets its own database (cloned from a migrated template) and its
own queue names, so tests never see each other's rows or messages. Nothing
here sleeps to synchronise: waits poll a condition against a deadline.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import pty
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import pika
import psycopg
import pytest

import drain
from drain.broker.publisher import Publisher
from drain.broker.queue_declare import QueueSpec
from drain.postgres import migration, sql
from drain.postgres.wakeup import WAKE_CLASS
from drain.settings.urls import broker_parameters
from tests import machine, roles

ROOT = Path(__file__).resolve().parent.parent
#: A port for a server a test starts (tests/machine.py).
free_port = machine.free_port
#: The run's Postgres (tests/services.py makes a cluster for each run) and RabbitMQ
#: (a vhost of the run's own).
ADMIN_URL = roles.ADMIN_URL
BROKER_URL = os.environ.get("DRAIN_TEST_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
#: Their ports on 127.0.0.1, for proxies in front of them (TcpProxy).
PG_PORT = urlsplit(ADMIN_URL).port or 5432
BROKER_PORT = urlsplit(BROKER_URL).port or 5672
#: The run's vhost as it stands in a broker URL's path ("/" is "" in Celery's spelling).
BROKER_VHOST_PATH = urlsplit(BROKER_URL).path.removeprefix("/")
#: ... and its name, as rabbitmqctl takes it.
BROKER_VHOST = unquote(BROKER_VHOST_PATH) or "/"


def database_url(name: str) -> str:
    """The superuser's URL of database ``name`` on the run's cluster."""
    return ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"


def broker_url(port: int | None = None, *, user: str = "guest", password: str = "guest") -> str:
    """A URL of the run's vhost, as ``user`` (through ``port``, e.g. a proxy's)."""
    return f"amqp://{user}:{password}@127.0.0.1:{port or BROKER_PORT}/{BROKER_VHOST_PATH}"


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


@contextlib.contextmanager
def database(name: str, template: str | None = None) -> Iterator[str]:
    """CREATE DATABASE (from ``template``), yield its URL, DROP it (even if in use).
    A template still in use by a session that is ending is waited for (10 s)."""
    clause = f' TEMPLATE "{template}"' if template else ""
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        deadline = time.monotonic() + 10
        while True:
            try:
                admin.execute(f'CREATE DATABASE "{name}"{clause}')
                break
            except psycopg.errors.ObjectInUse:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    try:
        yield database_url(name)
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            if template is None:  # a copy has its template's roles, none of its own
                drop_roles_of(admin, name)


def drop_roles_of(admin: psycopg.Connection[Any], name: str) -> None:
    """The group roles a migrate of database ``name`` made (``<name>_drain_*``), once
    the database is gone: roles outlive it. Roles still granted something
    elsewhere (a template's, while its copies live) stay."""
    with contextlib.suppress(psycopg.errors.DependentObjectsStillExist):
        admin.execute("DROP ROLE IF EXISTS " + ", ".join(
            f'"{role}"' for role in migration.role_names(f"{name}_drain_")))


def wait_for(
    condition: Callable[[], Any], timeout: float, what: str, interval: float = 0.05
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


# -- broker ------------------------------------------------------------------------


@contextlib.contextmanager
def broker_channel() -> Iterator[Any]:
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        yield conn.channel()
    finally:
        with contextlib.suppress(Exception):
            conn.close()


def delete_queue(queue: str) -> None:
    """Delete the queue, and the exchange of the same name a Celery worker declares for it."""
    with broker_channel() as ch:
        ch.queue_delete(queue)
        ch.exchange_delete(queue)  # deleting a missing exchange is not an error


def publisher(broker: str | pika.ConnectionParameters = BROKER_URL, *,
              confirm_timeout: float = 10,
              specs: Callable[[str], QueueSpec] | None = None) -> Publisher:
    """The drain's publisher (drain.broker.publisher), connected: to a broker URL, or
    with pika's parameters as given (what a drain URL does not take: channel_max)."""
    params = broker_parameters(broker) if isinstance(broker, str) else broker
    pub = Publisher(params, display_url="broker", confirm_timeout=confirm_timeout,
                    specs=specs)
    pub.connect()
    return pub


def queue_depth(queue: str) -> int:
    with broker_channel() as ch:
        try:
            return int(ch.queue_declare(queue, passive=True).method.message_count)
        except pika.exceptions.ChannelClosedByBroker:
            return 0


def drain_queue(queue: str, timeout: float = 2.0) -> list[tuple[Any, Any, bytes]]:
    """Consume (and ack) every message now in ``queue``: [(method, properties, body)].

    The queue's message count says how many are there now: those are awaited
    however long a loaded machine takes to deliver them (a gap of ``timeout``
    seconds between two deliveries ended the read early, and a test saw
    thousands of confirmed jobs 'missing'); only after them does ``timeout``
    of silence end it."""
    out: list[tuple[Any, Any, bytes]] = []
    with broker_channel() as ch:
        try:
            held = ch.queue_declare(queue, passive=True).method.message_count
        except pika.exceptions.ChannelClosedByBroker:
            return out
        deadline = time.monotonic() + 300
        for method, properties, body in ch.consume(queue, inactivity_timeout=timeout):
            if method is None:
                if len(out) < held and time.monotonic() < deadline:
                    continue
                break
            out.append((method, properties, body))
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    return out


def task_ids(messages: list[tuple[Any, Any, bytes]]) -> list[str]:
    return [str(p.headers["id"]) for _, p, _ in messages]


def stage_backlog(db_url: str, queue: str, n: int) -> dict[str, int]:
    """Stage ``n`` jobs in one transaction (COPY), as an application does: as the
    drain_stager role (tests/roles.py); {task id: i}, args [i], kwargs {"i": i}."""
    with psycopg.connect(roles.url(db_url, roles.STAGER)) as conn:
        ids = drain.stage_many(
            conn, (drain.Job("celery_app.record", [i], {"i": i}, queue=queue) for i in range(n))
        )
    return {str(task_id): i for i, task_id in enumerate(ids)}


def check_at_least_once(
    messages: list[tuple[Any, Any, bytes]], staged: dict[str, int]
) -> collections.Counter[str]:
    """Every staged job arrived, nothing else did, and all copies of a job are identical."""
    copies: collections.Counter[str] = collections.Counter()
    bodies: dict[str, set[bytes]] = collections.defaultdict(set)
    for _, props, body in messages:
        task_id = str(props.headers["id"])
        assert task_id in staged, f"published a job that was never committed: {task_id}"
        assert props.correlation_id == task_id
        args, kwargs, _embed = json.loads(body)
        assert args == [staged[task_id]] and kwargs == {"i": staged[task_id]}
        copies[task_id] += 1
        bodies[task_id].add(body)
    missing = set(staged) - set(copies)
    assert not missing, f"{len(missing)} committed job(s) never reached the queue"
    assert all(len(b) == 1 for b in bodies.values()), "copies of one job differ"
    return copies


# -- postgres ----------------------------------------------------------------------


def pgbench() -> str:
    """pgbench (Postgres' C load client): on PATH or in Debian's versioned bin directory."""
    found = shutil.which("pgbench")
    if found:
        return found
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True)
    if not candidates:
        pytest.fail("pgbench not found: it ships with Debian's postgresql packages")
    return str(candidates[0])


def as_an_older_schema(db_url: str) -> None:
    """Turn a migrated database back into one from before "no queue given" was NULL
    (staged_jobs.queue NOT NULL DEFAULT 'celery', no queue_legacy) and before the
    embed column (callbacks and chains), as a database from then is."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN queue_legacy")
        conn.execute("ALTER TABLE dead_jobs DROP COLUMN queue_legacy")
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN embed")
        conn.execute("ALTER TABLE dead_jobs DROP COLUMN embed")
        conn.execute("ALTER TABLE staged_jobs ALTER queue SET DEFAULT 'celery', "
                     "ALTER queue SET NOT NULL")
        conn.execute("ALTER TABLE dead_jobs ALTER queue SET NOT NULL")
        conn.execute("DROP TABLE drain_schema_state")


def as_upgraded_by_an_older_drain(db_url: str, mark: int) -> None:
    """Turn a migrated database back into one an older drain's `drain migrate`
    upgraded: "no queue given" is NULL, no queue_legacy, and the first id staged
    after that upgrade recorded (queue_given_from_id = ``mark``)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE staged_jobs DROP COLUMN queue_legacy")
        conn.execute("ALTER TABLE dead_jobs DROP COLUMN queue_legacy")
        conn.execute("UPDATE drain_schema_state SET value = %s "
                     "WHERE key = 'queue_given_from_id'", [mark])


def connect(url: str, **kwargs: Any) -> psycopg.Connection[Any]:
    return psycopg.connect(url, **kwargs)


def explain_buffers(conn: psycopg.Connection[Any], query: str, params: dict[str, object]) -> int:
    """The shared buffers (hit or read) ``query`` touches, from EXPLAIN ANALYZE: how
    much of the index and heap a read steps over."""
    row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params).fetchone()
    assert row is not None
    plan = row[0][0]["Plan"]
    return int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0))


@contextlib.contextmanager
def held_snapshot(url: str) -> Iterator[psycopg.Connection[Any]]:
    """A forgotten read-only transaction: vacuum keeps every row deleted while it lasts."""
    with psycopg.connect(url) as analytics:
        analytics.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        analytics.execute("SELECT count(*) FROM staged_jobs").fetchone()
        try:
            yield analytics
        finally:
            analytics.rollback()


def staged_count(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        return int(row[0]) if row else 0


def executed(url: str) -> list[dict[str, Any]]:
    """Rows of celery_app's executed_jobs (empty until a worker ran a task)."""
    with psycopg.connect(url) as conn:
        exists = conn.execute("SELECT to_regclass('executed_jobs') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return []
        cur = conn.execute(
            "SELECT task_id::text, task_name, args, kwargs FROM executed_jobs ORDER BY seq"
        )
        return [
            {"task_id": r[0], "task_name": r[1], "args": r[2], "kwargs": r[3]}
            for r in cur.fetchall()
        ]


# -- processes ---------------------------------------------------------------------


class Process:
    """A subprocess whose combined output goes to a file the test can read."""

    def __init__(
        self, argv: list[str], env: dict[str, str], log_path: Path,
        stop_signal: int = signal.SIGTERM, cwd: Path = ROOT,
    ) -> None:
        self.argv = argv
        self.stop_signal = stop_signal
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        if argv[1:3] == ["-m", "drain"]:
            roles.census_note(env.get("DRAIN_DATABASE_URL"), f"drain {roles.command_of(argv[3:])}")
        self.proc = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd,
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_output(self, text: str, timeout: float = 30.0, after: int = 0) -> None:
        wait_for(
            lambda: text in self.output()[after:] or self._died(text),
            timeout,
            f"{text!r} in the output of {' '.join(self.argv[:4])}",
        )
        if text not in self.output()[after:]:
            raise AssertionError(
                f"process exited with {self.proc.returncode} before printing {text!r}:\n"
                + self.output()[-3000:]
            )

    def _died(self, _text: str) -> bool:
        return self.proc.poll() is not None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.kill(self.stop_signal)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill(signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()


class Terminal:
    """A subprocess whose stdout and stderr (and stdin, with ``stdin``) are a
    terminal, as an operator's are: it asks, and redraws."""

    def __init__(self, argv: list[str], env: dict[str, str], *, stdin: bool = True) -> None:
        self.controller, terminal = pty.openpty()
        self.proc = subprocess.Popen(
            argv, env=env, stdin=terminal if stdin else subprocess.DEVNULL, stdout=terminal,
            stderr=terminal, cwd=ROOT, start_new_session=True)
        os.close(terminal)
        self.seen = b""

    def read(self) -> str:
        """Everything it wrote so far (reads what is there, never waits)."""
        while select.select([self.controller], [], [], 0)[0]:
            try:
                chunk = os.read(self.controller, 65536)
            except OSError:  # the other side closed
                break
            if not chunk:
                break
            self.seen += chunk
        return self.seen.decode(errors="replace")

    def answer(self, text: str) -> None:
        os.write(self.controller, text.encode() + b"\n")

    def finish(self, timeout: float = 60) -> tuple[int, str]:
        """Wait for it to exit: its exit code and everything it wrote."""
        code = self.proc.wait(timeout)
        return code, self.read()

    def close(self) -> None:
        """Teardown: kill it if it still runs, and close the terminal."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        os.close(self.controller)


def http_get(port: int, path: str) -> tuple[int, str]:
    """GET http://127.0.0.1:<port><path>: (status, body), an HTTP error status included."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return int(resp.status), resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def drain_env(db_url: str, role: str = roles.RUNNER, **extra: str) -> dict[str, str]:
    """The environment of a ``drain`` process on ``db_url``, as ``role`` (tests/roles.py:
    the drain's least-privileged role by default; roles.ADMIN for the superuser). The
    test's Celery app (celery_app, CELERY_APP_DATABASE_URL) writes as the superuser."""
    # The drain's own settings come from here alone; the run's addresses
    # (DRAIN_TEST_*, tests/services.py) go through to the test apps.
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DRAIN_", "PG")) or k.startswith("DRAIN_TEST_")}
    env.update(
        DRAIN_DATABASE_URL=roles.url(db_url, role),
        DRAIN_BROKER_URL=BROKER_URL,
        CELERY_APP_DATABASE_URL=db_url,
        PYTHONUNBUFFERED="1",
        # Many drains run at once in the tests: metrics only where a test asks for them.
        DRAIN_METRICS_PORT="0",
    )
    env.update(extra)
    return env


def drain_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "drain", *args]


def run_cli(
    db_url: str, *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """Run ``drain ARGS`` to completion and capture its output, as the role that runs
    that command (tests/roles.py): also when ``env`` is a :func:`drain_env` of
    ``db_url`` with its default role (give ``drain_env(db_url, roles.ADMIN)`` for
    the superuser)."""
    env = dict(env or drain_env(db_url))
    if env.get("DRAIN_DATABASE_URL") == roles.url(db_url, roles.RUNNER):
        env["DRAIN_DATABASE_URL"] = roles.for_command(db_url, *args)
    given = [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--database-url"]
    roles.census_note(given[-1] if given else env.get("DRAIN_DATABASE_URL"),
                      f"drain {roles.command_of(args)}")
    return subprocess.run(
        drain_argv(*args), env=env, capture_output=True, text=True,
        timeout=timeout, cwd=ROOT, check=False, stdin=subprocess.DEVNULL,
    )


def celery_argv(queue: str) -> list[str]:
    # The threads pool, not solo: under a steady stream, Celery 5.7's solo pool
    # left delivered messages unprocessed for ~10 s at a time (seen as bursts
    # of work ten seconds apart); one thread keeps the processing order.
    return [
        sys.executable, "-m", "celery", "-A", "celery_app", "worker", "-Q", queue,
        "-P", "threads", "-c", "1", "--without-gossip", "--without-mingle",
        "-l", "info", "-n", f"{queue}@%h",
    ]


# -- a TCP proxy for cutting and restoring connections -------------------------------------


class _Link:
    """One proxied connection: the client's socket, the upstream one, and a valve
    each way (``flowing``: towards upstream, ``replies``: back to the client)."""

    def __init__(self, client: socket.socket, upstream: socket.socket, flowing: bool) -> None:
        self.sockets = (client, upstream)
        self.flowing = threading.Event()
        self.replies = threading.Event()
        if flowing:
            self.flowing.set()
            self.replies.set()

    def valve(self, src: socket.socket) -> threading.Event:
        return self.flowing if src is self.sockets[0] else self.replies

    def close(self) -> None:
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()
        self.flowing.set()  # a pipe waiting at the valve wakes up and finds the sockets closed
        self.replies.set()


def via_proxy(db_url: str, port: int) -> str:
    """A test database's URL (support.database_url) through a TcpProxy on ``port``."""
    proxied = db_url.replace(f"@127.0.0.1:{PG_PORT}/", f"@127.0.0.1:{port}/")
    assert proxied != db_url, f"not a test database URL: {db_url}"
    return proxied


class TcpProxy:
    """Forwards 127.0.0.1:<port> to a target; can cut, stall, refuse and restore connections.

    * :meth:`cut` drops every open connection; new ones are still accepted.
    * :meth:`stall` stops forwarding without closing anything (a black hole: the
      sockets stay open, bytes are held back); :meth:`resume` forwards again,
      held bytes included.
    * :meth:`refuse` cuts every connection and stops listening, so connecting
      gets "connection refused" (a service that is down); :meth:`restart`
      listens again on the same port.
    * :meth:`throttle` forwards what clients send at a set rate (a slow link).
    * :meth:`stop` (teardown) is :meth:`refuse`.
    """

    def __init__(self, target_port: int, port: int | None = None) -> None:
        self.target = ("127.0.0.1", target_port)
        self.port = port or free_port()
        self._server: socket.socket | None = None
        self._links: list[_Link] = []
        self._stall_new = False
        self._lock = threading.Lock()
        #: Connections accepted so far (over every start/restart).
        self.accepted = 0
        self._held = 0
        #: Bytes a second forwarded from clients (0: as fast as they come).
        self._rate = 0

    def start(self) -> TcpProxy:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # The port was ours a moment ago (restart): another socket may hold it briefly.
        deadline = time.monotonic() + 10
        while True:
            try:
                server.bind(("127.0.0.1", self.port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    server.close()
                    raise
                time.sleep(0.05)
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()
        return self

    def restart(self) -> TcpProxy:
        """Listen again on the same port after :meth:`refuse` (no-op while listening)."""
        if self._server is None:
            self.start()
        return self

    @property
    def listening(self) -> bool:
        return self._server is not None

    @property
    def held(self) -> int:
        """Directions of the connections whose bytes a stall holds back now."""
        with self._lock:
            return self._held

    @property
    def open_connections(self) -> int:
        with self._lock:
            return len(self._links)

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._server is not server:  # refused meanwhile
                    client.close()
                    upstream.close()
                    return
                link = _Link(client, upstream, flowing=not self._stall_new)
                self._links.append(link)
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(link, a, b), daemon=True).start()

    def _pipe(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            valve = link.valve(src)
            while data := src.recv(65536):
                if not valve.is_set():
                    with self._lock:
                        self._held += 1
                    valve.wait()
                    with self._lock:
                        self._held -= 1
                if self._rate and src is link.sockets[0]:
                    self._trickle(dst, data)
                else:
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            src.close()  # each direction's thread closes the socket it reads from
            with self._lock, contextlib.suppress(ValueError):
                self._links.remove(link)

    def throttle(self, bytes_per_second: int) -> None:
        """Forward what clients send at most this fast, a small piece at a time
        (0: as fast as it comes). What comes back is not held up."""
        self._rate = bytes_per_second

    def _trickle(self, dst: socket.socket, data: bytes) -> None:
        piece = max(1, self._rate // 20)  # 20 pieces a second
        for i in range(0, len(data), piece):
            dst.sendall(data[i:i + piece])
            if self._rate:
                time.sleep(piece / self._rate)  # the link's pace, not a synchronisation

    def cut(self) -> None:
        """Drop every open connection (new ones are still accepted)."""
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()

    def stall(self, *, new_connections: bool = True, replies_only: bool = False) -> None:
        """Stop forwarding on every open connection, keeping the sockets open.

        With ``new_connections`` (the default) connections accepted from now on
        stall too (a broker that hangs); otherwise they flow (one half-dead link).
        With ``replies_only``, only what comes back from upstream is held: what
        the client sends, and its close, still go through (a path that went
        silent one way, which the server side does not see).
        """
        with self._lock:
            self._stall_new = new_connections
            for link in self._links:
                link.replies.clear()
                if not replies_only:
                    link.flowing.clear()

    def resume(self) -> None:
        """Forward again on every connection, the bytes held back first."""
        with self._lock:
            self._stall_new = False
            for link in self._links:
                link.flowing.set()
                link.replies.set()

    def refuse(self) -> None:
        """Cut every connection and stop listening: connecting is refused until restart()."""
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            # close() alone does not wake a thread blocked in accept(), which would
            # go on accepting; shutdown() does, and stops the listening at once.
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        self.cut()

    def stop(self) -> None:
        self.resume()
        self.refuse()


def dumps(value: Any) -> str:
    return json.dumps(value)


@contextlib.contextmanager
def wake_flag_raised(db_url: str) -> Iterator[psycopg.Connection[Any]]:
    """Staging notifies as it does while a drain sleeps armed (drain.postgres.wakeup): a
    session of our own holds the sentinel lock and raises the wake flag; both
    are put back on the way out."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        assert conn.execute(sql.query("take_sentinel"), sentinel(conn)).fetchone() == (True,)
        conn.execute(sql.query("raise_flag"))
        try:
            yield conn
        finally:
            conn.execute(sql.query("lower_flag"))


def sentinel(conn: psycopg.Connection[Any]) -> dict[str, object]:
    """The sentinel lock's parameters for drain's queries (drain.postgres.store)."""
    row = conn.execute(sql.query("schema_present")).fetchone()
    assert row is not None
    return {"class": WAKE_CLASS, "key": row[0]}


def nested(depth: int) -> list[Any]:
    """A list nested ``depth`` deep: ``[[[...]]]`` (deeper than the recursion limit
    for staging's refusal of deep arguments)."""
    top: list[Any] = []
    inner = top
    for _ in range(depth - 1):
        inner.append([])
        inner = inner[0]
    return top
