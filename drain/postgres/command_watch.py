"""Serving the broker's connection while the drain's loop waits for a Postgres command.

The loop's thread runs each Postgres command itself (drain.postgres.session); a
:class:`Watch` thread turns the broker's I/O loop meanwhile once a command has
waited SERVE_EVERY, so heartbeats and confirms go on while a statement waits for a
lock.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("drain.session")

#: Seconds between two calls of ``serve`` while a command waits.
SERVE_EVERY = 0.2


class Watch:
    """A thread that calls ``serve`` while the calling thread waits for a command.

    pika is not thread-safe, so ``serve`` (the broker's I/O loop) must never
    run while the loop's thread uses the broker connection itself. The rule
    that guarantees it: the watch calls ``serve`` only while holding its
    lock and seeing a command in progress (:meth:`command`), and the loop's
    thread, once its command returns or raises, takes that lock before it
    marks the command done and goes on. So ``serve`` runs only while the
    loop's thread is inside ``conn.execute`` (which never touches the
    broker), and a ``serve`` in progress when the answer comes returns before
    the loop's thread leaves the command; the lock also orders what ``serve``
    changed (confirms received, say) before what the loop's thread reads next.

    Why not the command on a helper thread, the loop's thread serving
    meanwhile (as it was): that is two thread wake-ups per command, on every
    command, to serve the few that wait. ``SELECT 1`` on a quiet loopback took
    0.025 ms (p50) on the calling thread and 0.05-0.09 ms through the helper;
    on a busy machine each wake-up also waits for a core, and a batch sends
    several commands. Here a command costs one uncontended lock and two
    assignments; the watch wakes every SERVE_EVERY / 2 whatever happens (one
    short look under the lock), and calls ``serve`` once a command has waited
    SERVE_EVERY, then every SERVE_EVERY until it ends. It ends with
    :meth:`stop` (Session.close; a later command starts a new one).
    """

    def __init__(self, serve: Callable[[], None]) -> None:
        self.serve = serve
        self._lock = threading.Lock()
        #: When the command in progress was sent (time.monotonic()); None: none is.
        self._since: float | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="drain-command-watch",
                                        daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def command(self) -> Iterator[None]:
        """Around one command on the loop's thread: ``serve`` may run meanwhile."""
        self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:  # a serve() in progress returns first
                self._since = None

    def stop(self) -> None:
        """End the thread (at most one ``serve`` in progress later)."""
        self._stopped.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _watch(self) -> None:
        served = 0.0
        while not self._stopped.wait(SERVE_EVERY / 2):
            with self._lock:
                since = self._since
                if since is None or time.monotonic() - max(since, served) < SERVE_EVERY:
                    continue
                try:
                    self.serve()
                except Exception:  # it must not raise; a thread that died would not serve
                    log.debug("while_waiting raised", exc_info=True)
                served = time.monotonic()
