"""Is anything listening at the server's addresses? A probe for the reconnect wait.

While Postgres (or RabbitMQ) is down, the drain retries its connection with exponential
backoff (up to ``max_backoff``, 10 s): few attempts, each a full libpq
connection (or AMQP handshake). Waiting out that backoff after the server came back costs up to
its whole length in resume time. So between attempts the drain also knocks
on the server's TCP port (or Postgres's Unix socket) every :data:`INTERVAL`: a refused
or unanswered knock costs the server nothing, and the first knock that is
accepted after one that was not ends the wait at once.

Only that transition ends a wait early: a server that accepts connections and
then refuses the login, is still starting up, is read-only or hangs is
knocked on successfully every time and is retried at the normal backoff, so
a server in trouble never sees a reconnect storm. Addresses come from the
connection string (``host``/``hostaddr``/``port``, several hosts too) or
``PGHOST``/``PGPORT``; with none (libpq's compiled-in default socket) there is
nothing to knock on and the backoff alone applies.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Callable
from typing import Any

from psycopg import conninfo

#: How often to knock while waiting, and how long one knock may take.
INTERVAL = 0.1
KNOCK_TIMEOUT = 0.1

Address = tuple[int, Any]  # (socket family, address for connect())


def addresses(dsn: str) -> list[Address]:
    """The addresses a connection to ``dsn`` would try, resolved now; [] when unknown."""
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except Exception:
        return []
    hosts = str(params.get("hostaddr") or params.get("host") or os.environ.get("PGHOST", ""))
    ports = str(params.get("port") or os.environ.get("PGPORT", "") or "5432")
    host_list = [h.strip() for h in hosts.split(",")] if hosts else []
    port_list = [p.strip() or "5432" for p in ports.split(",")]
    found: list[Address] = []
    for i, host in enumerate(host_list):
        port_text = port_list[i] if i < len(port_list) else port_list[-1]
        if not host or not port_text.isdigit():
            continue
        port = int(port_text)
        if host.startswith("/"):
            found.append((socket.AF_UNIX, f"{host}/.s.PGSQL.{port}"))
        else:
            found.extend(tcp_addresses(host, port))
    return found


def tcp_addresses(host: str, port: int) -> list[Address]:
    """``host:port`` resolved now; [] when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        return []
    return [(family, address) for family, _, _, _, address in infos]


def listening(targets: list[Address], timeout: float = KNOCK_TIMEOUT) -> bool:
    """True when any of ``targets`` accepts a connection (closed again at once)."""
    for family, address in targets:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            sock.connect(address)
            return True
    return False


class Watch:
    """Tells when a server that was not listening listens again.

    ``resolve`` gives the addresses to knock on; it runs at the first knock, so
    a drain resolves names only once it is waiting to reconnect, and afresh for
    each outage (a failover may have moved the name).
    """

    def __init__(self, resolve: Callable[[], list[Address]]) -> None:
        self._resolve = resolve
        self._targets: list[Address] | None = None
        self._seen_down = False

    def came_back(self) -> bool:
        """Knock once; True on the first accepted knock after a refused one."""
        if self._targets is None:
            self._targets = self._resolve()
        if not self._targets:
            return False
        if not listening(self._targets):
            self._seen_down = True
            return False
        back, self._seen_down = self._seen_down, False
        return back
