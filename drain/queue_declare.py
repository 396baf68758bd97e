"""Declaring the queues a batch goes to, on a channel of their own.

:class:`QueueDeclaringLink` adds to :class:`drain.amqp_link.AmqpLink` the
queue declares that come before publishing: each queue is declared (durable,
as Celery does, or only checked with ``passive``) once per connection, the
first time a batch goes to it, and again after :meth:`QueueDeclaringLink.forget`
(it went missing). The declares go through a second channel, which the
broker closes when it refuses one, so the publishing channel and the batches
in flight on it are not disturbed. :class:`drain.publisher.Publisher` builds
on this.
"""

from __future__ import annotations

from typing import Any

import pika

from drain.amqp_link import AmqpLink
from drain.errors import BrokerBlocked, BrokerUnavailable


class QueueDeclaringLink(AmqpLink):
    """An :class:`AmqpLink` that declares queues, each once per connection."""

    def __init__(
        self,
        parameters: pika.ConnectionParameters,
        *,
        display_url: str,
        declare: str = "celery",
        connect_timeout: float = 10.0,
        secrets: list[str] | None = None,
        queue_max_priority: int = 0,
    ) -> None:
        super().__init__(parameters, display_url=display_url,
                         connect_timeout=connect_timeout, secrets=secrets)
        self._declare_mode = declare
        self._declared: set[str] = set()
        self._declare_channel: Any = None
        self._declare_refusal: str | None = None
        self._queue_arguments = (
            {"x-max-priority": queue_max_priority} if queue_max_priority else None
        )

    def _new_connection(self) -> None:
        super()._new_connection()
        self._declared.clear()

    def close(self) -> None:
        """Close the connection (if any); never raises."""
        self._declare_channel = None
        super().close()

    def declare(self, queues: set[str]) -> dict[str, str]:
        """Declare (or, passively, check) the queues not declared yet on this connection.

        Returns the refused queues with the broker's reason (406 for a queue that
        exists with other arguments, 404 for a missing queue in passive mode).
        Declares go through a channel of their own, which a refusal closes, so
        the publishing channel and the batches in flight are not disturbed.
        Raises :class:`BrokerUnavailable` when the connection itself fails, and
        :class:`BrokerBlocked` when the broker blocks it before answering.
        """
        refused: dict[str, str] = {}
        for queue in sorted(queues - self._declared):
            self._raise_if_failed()
            channel = self._declare_channel_open()
            answer: dict[str, str] = {}

            def on_declared(_frame: Any, answer: dict[str, str] = answer) -> None:
                answer["ok"] = ""
                self._wake()

            channel.queue_declare(
                queue,
                passive=self._declare_mode == "passive",
                durable=True,
                arguments=self._queue_arguments,
                callback=on_declared,
            )
            def answered(answer: dict[str, str] = answer) -> bool:
                return (bool(answer) or self._declare_channel is None
                        or self._failure is not None or self.blocked is not None)

            self._run_until(answered, self._connect_timeout)
            if not answer and self._failure is None and self.blocked is not None:
                raise BrokerBlocked(self.blocked)  # the answer comes after the alarm
            if "ok" in answer:
                self._declared.add(queue)
            elif self._failure is not None:
                self._raise_if_failed()
            elif self._declare_channel is None:
                refused[queue] = self._declare_refusal or "refused"
            else:
                raise BrokerUnavailable(
                    f"broker at {self._display_url} did not answer a queue declare in time"
                )
        return refused

    def forget(self, queue: str) -> None:
        """Declare ``queue`` again before the next publish to it (it went missing)."""
        self._declared.discard(queue)

    def _declare_channel_open(self) -> Any:
        if self._declare_channel is None:
            conn = self._conn
            if conn is None:
                raise BrokerUnavailable(f"broker at {self._display_url}: not connected")
            opened: list[Any] = []

            def on_open(channel: Any) -> None:
                channel.add_on_close_callback(self._on_declare_channel_closed)
                opened.append(channel)
                self._wake()

            conn.channel(on_open_callback=on_open)
            self._run_until(lambda: bool(opened) or self._failure is not None,
                            self._connect_timeout)
            self._raise_if_failed()
            if not opened:
                raise BrokerUnavailable(f"broker at {self._display_url}: no channel in time")
            self._declare_channel = opened[0]
            self._declare_refusal = None
        return self._declare_channel

    def _on_declare_channel_closed(self, _channel: Any, exc: BaseException) -> None:
        self._declare_channel = None
        self._declare_refusal = self._text(exc)
        self._wake()
