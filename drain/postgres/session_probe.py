"""Is the drain's connection a Postgres session of its own? (PgBouncer and the like)

The drain keeps its advisory lock, its LISTEN and each batch transaction on one
session, and its safety rests on that: the lock is the proof that no other
drain publishes, and losing the session must end the batch and free the lock
together. A pool in *transaction* mode (PgBouncer's ``pool_mode =
transaction``) hands the server connection to the next client as soon as a
transaction ends; one in *statement* mode after every statement. Through such a
pool the lock stays behind on a server connection that other clients then use,
two drains can both believe they hold it, and a NOTIFY reaches whoever is on
the listening server connection. :func:`check` runs when the drain connects,
before LISTEN and the lock, and refuses such a connection with
:class:`~drain.errors.PoolWithoutSession` (fatal: ``drain run`` exits).

How it decides, cheapest and most definitive first:

1. **Postgres answered the startup itself.** A server sends its backend's pid in
   the startup reply (BackendKeyData, ``conn.info.backend_pid``). A pool must
   answer cancel requests itself, since it decides which server connection a
   client is on, so it hands each client a key of its own (PgBouncer draws it
   at random). When that pid equals ``pg_backend_pid()``, nothing but a byte
   forwarder (a TCP proxy) sits between the drain and its backend: the session
   is the drain's own. One round trip; the direct case stops here.
2. **Something else answered: a pool.** Its mode is not visible to a client
   (PgBouncer's ``SHOW CONFIG`` needs its admin console), so the probe watches
   the pool hand out server connections. On the drain's connection A it sets a
   session setting, ``drain.postgres.session_probe``, to a random token (not transaction
   local) and notes the backend's pid. It opens a short-lived second connection
   B to the same pool address (pinned to the host and port A reached), and the
   two take turns, :data:`LOOKS` times: A reads the setting and pid back (they
   must not have changed), then B reads them (it must not see A's). Then B
   begins a transaction and reads them once more, and while that transaction
   holds B's server connection A reads them :data:`LOOKS` more times.

   In a session pool A's server connection belongs to A until A disconnects: B
   can never be handed it and A never leaves it, so a session pool always
   passes, whatever else runs through it. A transaction pool gives an idle
   client's server connection to the next client that asks: with PgBouncer's
   default (``server_round_robin = 0``, most recently released first) B, asking
   right after A's look, is handed A's and sees the token; one that hands them
   out in turn (``server_round_robin = 1``) moves A's own next statement as soon
   as more than one is idle, and hands B A's when it is the only one. A
   statement pool does the same, and refuses B's transaction block besides
   ("transaction blocks not allowed in statement pooling mode"). Any of these
   refuses the connection.

Tokens and pids are compared together: a token seen elsewhere can only have
come from A's server connection, and a pid cannot be mistaken across servers.
The setting is custom (PgBouncer does not track it) and private to one server
connection; nothing else reads it.

Other clients' traffic can make single looks come back as a session pool's
would (a client that takes A's server connection between two looks and gives it
back), which is why the sides take turns several times: with one look each, a
probe was fooled in 5-13 % of tries against a transaction pool busy with other
clients; taking turns five times, in none of 2,400 (1 to 8 other clients,
statements and transactions, both ``server_round_robin`` settings;
tests/acceptance/test_pgbouncer.py keeps such a test). What it cannot see: B can
land on another pool than A when several PgBouncer processes share the port
(``so_reuseport``) or a load balancer spreads connections over several pools,
and then only A's own looks can give a transaction pool away. The probe is a
check at connect time, not a guarantee for every later statement: run the drain
directly against Postgres or through a session-mode pool of its own.

Costs (2-core development machine, under load): the direct case, one round trip
(p50 ~0.8 ms, on top of a ~10 ms connect); through a session pool, a second
connection to the pool and 13 short round trips, p50 ~3-9 ms. B waits at most
:data:`TIMEOUT` to connect and to be served (a full pool makes it queue): a
probe that cannot finish is an outage, retried with backoff like any other,
never a pass. A session-mode pool therefore needs room for one more server
connection while a drain connects.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import select
import time

import psycopg
from psycopg import conninfo, pq

from drain.errors import DatabaseUnavailable, PoolWithoutSession
from drain.settings.url_parts import first_line
from drain.settings.urls import scrub

log = logging.getLogger("drain.session_probe")

#: The custom setting the token is written to (session-level, on A only).
SETTING = "drain.postgres.session_probe"
#: Looks on each side per step (each one statement, ~0.1 ms): under other clients'
#: traffic every look is another chance for a transaction pool to show itself.
LOOKS = 5
#: Seconds the second connection may take to connect, and then to be served.
TIMEOUT = 3.0
#: A statement pool refusing a transaction block (PgBouncer: "transaction blocks
#: not allowed in statement pooling mode").
_STATEMENT_POOL = re.compile(r"statement pool", re.IGNORECASE)
#: The libpq options that choose where to connect: B goes where A went.
_WHERE = ("host", "hostaddr", "port", "target_session_attrs", "load_balance_hosts")

_READ = f"SELECT pg_backend_pid(), current_setting('{SETTING}', true)"

Look = tuple[int, str | None]


def check(
    conn: psycopg.Connection[tuple[object, ...]], dsn: str, display: str, secret: list[str]
) -> int:
    """Refuse ``conn`` unless it is a stable session; return its server backend's pid.

    ``conn`` is the drain's fresh autocommit connection made from ``dsn``;
    ``display`` is the masked URL for messages and ``secret`` the passwords to
    scrub. Raises :class:`PoolWithoutSession` (fatal) or
    :class:`DatabaseUnavailable` (the probe could not finish: retried);
    psycopg errors on ``conn`` itself propagate.
    """
    started = time.perf_counter()
    token = secrets.token_hex(16)
    row = conn.execute(f"SELECT pg_backend_pid(), set_config('{SETTING}', %s, false)",
                       [token], prepare=False).fetchone()
    pid = row[0] if row else None
    assert isinstance(pid, int)
    if pid == conn.info.backend_pid:
        return pid  # Postgres itself answered the startup: no pool in between
    mine: Look = (pid, token)
    with _Second(conn, dsn, display, secret) as other:
        # Turn about: a look of one side releases its server connection just
        # before the other side asks for one.
        for _ in range(LOOKS):
            _stays(conn, mine, display)
            _apart(other.look(), mine, display)
        _apart(other.look(begin=True), mine, display)  # B keeps its server connection now
        for _ in range(LOOKS):
            _stays(conn, mine, display)
        other.finish()
    log.debug("database %s: a pool keeps this session (checked in %.1f ms)",
              display, (time.perf_counter() - started) * 1000)
    return pid


def _stays(conn: psycopg.Connection[tuple[object, ...]], mine: Look, display: str) -> None:
    """A's statement must run where the token was set."""
    row = conn.execute(_READ, prepare=False).fetchone()
    if row is None or row != mine:
        raise _refusal(display, "its statements ran on more than one server connection")


def _apart(theirs: Look, mine: Look, display: str) -> None:
    """B must never be on A's server connection."""
    if theirs[0] == mine[0] or theirs[1] == mine[1]:
        raise _refusal(display, "another client was handed its server connection")


def _refusal(display: str, evidence: str) -> PoolWithoutSession:
    return PoolWithoutSession(
        f"database {display} is reached through a pool that does not keep a session "
        f"({evidence}; PgBouncer in transaction or statement mode?): the drain needs its own "
        "session for the advisory lock and LISTEN; connect it directly or through a "
        "session-mode pool"
    )


class _Second:
    """Connection B: to where A went, its statements bounded by :data:`TIMEOUT`."""

    def __init__(self, conn: psycopg.Connection[tuple[object, ...]], dsn: str,
                 display: str, secret: list[str]) -> None:
        self._display = display
        self._secret = secret
        try:
            self._conn = psycopg.connect(_same_place(conn, dsn), autocommit=True)
        except psycopg.Error as exc:
            raise self._unavailable(
                f"a second connection failed: {scrub(first_line(exc), secret)}") from None
        self._deadline = time.monotonic() + TIMEOUT

    def __enter__(self) -> _Second:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._conn.close()

    def look(self, *, begin: bool = False) -> Look:
        """(pid, token) as B sees them; with ``begin``, in a transaction left open."""
        pgconn = self._conn.pgconn
        try:
            if begin:
                _run(pgconn, b"BEGIN", self._deadline)
            result = _run(pgconn, _READ.encode(), self._deadline)
        except TimeoutError:
            raise self._unavailable(
                f"a second connection was not served within {TIMEOUT:g}s: pool full?") from None
        except psycopg.Error as exc:
            text = first_line(exc)
            if _STATEMENT_POOL.search(text):
                raise _refusal(self._display, "the pool refused a transaction block") from None
            raise self._unavailable(
                f"a second connection failed: {scrub(text, self._secret)}") from None
        pid, value = result.get_value(0, 0), result.get_value(0, 1)
        return int(pid or b"0"), None if value is None else value.decode()

    def finish(self) -> None:
        """Roll back, so that a transaction pool takes the server connection back clean."""
        with contextlib.suppress(psycopg.Error, TimeoutError):
            _run(self._conn.pgconn, b"ROLLBACK", time.monotonic() + TIMEOUT)

    def _unavailable(self, what: str) -> DatabaseUnavailable:
        return DatabaseUnavailable(
            f"database {self._display}: could not check that the pool keeps sessions ({what})")


def _same_place(conn: psycopg.Connection[tuple[object, ...]], dsn: str) -> str:
    """``dsn`` pinned to the host and port ``conn`` reached (a multi-host URL could
    send B elsewhere), with a bounded connect."""
    params = {k: v for k, v in conninfo.conninfo_to_dict(dsn).items() if k not in _WHERE}
    info = conn.info
    params.update(host=info.host, port=str(info.port), connect_timeout=str(int(TIMEOUT)),
                  application_name="drain session probe")
    with contextlib.suppress(psycopg.NotSupportedError):
        if info.hostaddr:
            params["hostaddr"] = info.hostaddr
    return conninfo.make_conninfo("", **params)


def _run(pgconn: pq.abc.PGconn, query: bytes, deadline: float) -> pq.abc.PGresult:
    """One simple query on a non-blocking libpq connection, waiting at most until
    ``deadline`` (monotonic): its last result. Raises TimeoutError, or a psycopg
    error for a failed query or connection."""
    pgconn.send_query(query)
    while pgconn.flush():
        _wait(pgconn, deadline, write=True)
    last: pq.abc.PGresult | None = None
    while True:
        while pgconn.is_busy():
            _wait(pgconn, deadline)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        if result.status == pq.ExecStatus.FATAL_ERROR:
            message = result.error_message.decode("utf-8", "replace").strip()
            raise psycopg.OperationalError(message or "query failed")
        last = result
    if last is None:
        raise psycopg.OperationalError(pgconn.get_error_message().strip() or "no result")
    return last


def _wait(pgconn: pq.abc.PGconn, deadline: float, *, write: bool = False) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    fd = pgconn.socket
    ready = select.select([], [fd], [], left) if write else select.select([fd], [], [], left)
    if not any(ready):
        raise TimeoutError
