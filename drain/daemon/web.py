"""The drain's small HTTP server: metrics, health, readiness and the status page.

Served on ``--metrics-host`` (127.0.0.1 by default: put a proxy or a scraper
on the same host, or bind 0.0.0.0 inside a container) and ``--metrics-port``:

=================  ==============================================================
``/metrics``       Prometheus text format (see :mod:`drain.daemon.metrics`)
``/healthz``       200 while the drain loop is alive: it went round within the
                   last :func:`drain.daemon.watchdog.stuck_after` seconds (its longest
                   configured wait, usually the confirm timeout, plus 30); 503
                   otherwise. For liveness probes: a 503 means restart it.
``/readyz``        200 when connected to the database, as leader or standby (a
                   standby is healthy: it takes over within a second); 503 while
                   the database is unreachable. JSON: ``ready``, ``role``, ``state``.
``/status.json``   the last sample (what ``drain status --json`` prints), the role,
                   and the history the status page draws
``/``              the status page (``drain/status.html``), refreshing itself
=================  ==============================================================

Nothing here reveals a URL or a password: the status is the same data
``drain status`` prints.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import TYPE_CHECKING, Any

from prometheus_client.exposition import choose_encoder

from drain.errors import ConfigError

if TYPE_CHECKING:
    from drain.daemon.metrics import Sampler
    from drain.daemon.runner import Drain

log = logging.getLogger("drain.web")


def status_page() -> bytes:
    """The status page shipped in the package."""
    page = resources.files("drain.daemon").joinpath("status.html")
    if page.is_file():
        return page.read_bytes()
    return b"<!doctype html><title>drain</title><p>status.html is missing; see /status.json"


class Server:
    """The HTTP server of one drain process, in a daemon thread."""

    def __init__(self, drain: Drain, sampler: Sampler, host: str, port: int) -> None:
        self.drain = drain
        self.sampler = sampler
        handler = type("Handler", (_Handler,), {"server_state": self})
        try:
            self._httpd = ThreadingHTTPServer((host, port), handler)
        except OSError as exc:
            raise ConfigError(
                f"cannot serve metrics on {host}:{port}: {exc.strerror or exc} (another drain "
                "on this host? give each its own --metrics-port, or 0 to turn it off)"
            ) from None
        self._httpd.daemon_threads = True
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="drain-http",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving /metrics, /healthz, /readyz and the status page on port %d", self.port)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._httpd.shutdown()
            self._httpd.server_close()

    def status_json(self) -> dict[str, Any]:
        last, sampled_at, history = self.sampler.snapshot()
        health = self.drain.health()
        return {
            "role": health["role"],
            "state": health["state"],
            "lanes": self.drain.settings.lanes,
            "lane": self.drain.settings.lane,
            "published": self.drain.published,
            "status": last,
            "sampled_at": sampled_at,
            "history": history,
        }


class _Handler(BaseHTTPRequestHandler):
    server_state: Server
    server_version = "drain"
    sys_version = ""

    def do_GET(self) -> None:
        state = self.server_state
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            # OpenMetrics when the scraper asks for it (Prometheus does): the only
            # exposition with exemplars (drain_job_wait_seconds' trace ids).
            encode, content_type = choose_encoder(self.headers.get("Accept", ""))
            self._send(HTTPStatus.OK, content_type, encode(state.drain.metrics.registry))
        elif path == "/healthz":
            alive = state.drain.health()["alive"]
            self._send(HTTPStatus.OK if alive else HTTPStatus.SERVICE_UNAVAILABLE,
                       "text/plain; charset=utf-8", b"ok\n" if alive else b"stalled\n")
        elif path == "/readyz":
            health = state.drain.health()
            body = {"ready": health["ready"], "role": health["role"], "state": health["state"]}
            self._json(HTTPStatus.OK if health["ready"] else HTTPStatus.SERVICE_UNAVAILABLE, body)
        elif path == "/status.json":
            self._json(HTTPStatus.OK, state.status_json())
        elif path in ("/", "/index.html"):
            self._send(HTTPStatus.OK, "text/html; charset=utf-8", status_page())
        else:
            self._send(HTTPStatus.NOT_FOUND, "text/plain; charset=utf-8", b"not found\n")

    def _json(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send(status, "application/json", json.dumps(body, default=str).encode())

    def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("http: " + format, *args)
