"""Consumers of some queues on threads of their own.

:class:`ConsumerThread` is the thread and its connection; :class:`Deliveries`
counts each delivery by its marker (the job's first argument): test_hot_row and
test_locked_rows count how often a job was delivered with it. The interleavings'
consumer (tests/interleaving_support.py) is another.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any, Self

import pika

from drain.settings.urls import broker_parameters
from tests import support


class ConsumerThread:
    """One pika connection on a thread of its own, turned every 20 ms until
    :meth:`stop`: a subclass subscribes in :meth:`_opened` (once) or :meth:`_turn`
    (before each turn). What the thread raised is kept as :attr:`error`."""

    def __init__(self, queues: list[str], name: str) -> None:
        self.queues = queues
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Self:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(15)

    def _run(self) -> None:
        try:
            conn = pika.BlockingConnection(broker_parameters(support.BROKER_URL))
            try:
                self._opened(conn)
                while not self._stop.is_set():
                    self._turn(conn)
                    conn.process_data_events(time_limit=0.02)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
        except Exception as exc:
            self.error = exc

    def _opened(self, conn: Any) -> None:
        """Once, when the connection is open."""

    def _turn(self, conn: Any) -> None:
        """Before each turn of the connection."""


class Deliveries(ConsumerThread):
    """Consumes the queues on its own thread: every delivery's args and when it came."""

    def __init__(self, queues: list[str]) -> None:
        super().__init__(queues, "hot-consumer")
        #: marker (args[0]) -> [(time.monotonic(), args)] of each delivery
        self.seen: dict[str, list[tuple[float, list[Any]]]] = {}
        self.ready = threading.Event()

    def _opened(self, conn: Any) -> None:
        ch = conn.channel()
        for queue in self.queues:
            ch.queue_declare(queue, durable=True)
            ch.basic_consume(queue, self._on_message, auto_ack=True)
        self.ready.set()

    def _on_message(self, _ch: Any, _method: Any, _props: Any, body: bytes) -> None:
        args = json.loads(body)[0]
        self.seen.setdefault(str(args[0]), []).append((time.monotonic(), args))

    def count(self, marker: str) -> int:
        return len(self.seen.get(marker, []))

    @contextlib.contextmanager
    def running(self) -> Iterator[Deliveries]:
        self.start()
        try:
            support.wait_for(lambda: self.ready.is_set() or self.error, 30, "the consumer")
            yield self
        finally:
            self.stop()
