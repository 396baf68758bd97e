"""A consumer of some queues on its own thread, counting each delivery by its marker
(the job's first argument): test_hot_row and test_locked_rows count how often a job
was delivered with it."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pika

from drain.settings.urls import broker_parameters
from tests import support


class Deliveries:
    """Consumes the queues on its own thread: every delivery's args and when it came."""

    def __init__(self, queues: list[str]) -> None:
        self.queues = queues
        #: marker (args[0]) -> [(time.monotonic(), args)] of each delivery
        self.seen: dict[str, list[tuple[float, list[Any]]]] = {}
        self.ready = threading.Event()
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hot-consumer", daemon=True)

    def _run(self) -> None:
        try:
            conn = pika.BlockingConnection(broker_parameters(support.BROKER_URL))
            try:
                ch = conn.channel()
                for queue in self.queues:
                    ch.queue_declare(queue, durable=True)
                    ch.basic_consume(queue, self._on_message, auto_ack=True)
                self.ready.set()
                while not self._stop.is_set():
                    conn.process_data_events(time_limit=0.02)
            finally:
                with contextlib.suppress(Exception):
                    conn.close()
        except Exception as exc:
            self.error = exc

    def _on_message(self, _ch: Any, _method: Any, _props: Any, body: bytes) -> None:
        args = json.loads(body)[0]
        self.seen.setdefault(str(args[0]), []).append((time.monotonic(), args))

    def count(self, marker: str) -> int:
        return len(self.seen.get(marker, []))

    @contextlib.contextmanager
    def running(self) -> Iterator[Deliveries]:
        self._thread.start()
        try:
            support.wait_for(lambda: self.ready.is_set() or self.error, 30, "the consumer")
            yield self
        finally:
            self._stop.set()
            self._thread.join(15)
