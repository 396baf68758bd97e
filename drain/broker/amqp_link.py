"""One AMQP connection and its channel, driven from the calling thread.

:class:`AmqpLink` owns the life of a pika ``SelectConnection``: opening it and
its channel (:meth:`AmqpLink.connect`), closing it, and turning its I/O loop.
Nothing runs in the background: the loop only turns inside ``connect``,
``pump`` and the waits of a subclass (:meth:`AmqpLink._run_until`), and a
pika callback that changes what is being waited for calls
:meth:`AmqpLink._wake` to stop the turn. It also follows the broker's
``connection.blocked`` / ``unblocked`` notices (a resource alarm), and turns
pika's errors into one short line with no secrets in it, telling a refusal
(login, vhost) from a network problem. A block ends with its connection: a
broker that blocks and then dies silently is noticed by the heartbeat, which
is never off (drain.broker.broker_options.heartbeat_for).

Given a :class:`drain.broker.broker_list.BrokerList` (a failover list), ``connect``
tries its brokers in the list's order (one pass, see drain.broker.broker_list) and
stays with the first that lets it in; every message then names that broker.

What goes over the channel is the subclass's business:
:class:`drain.broker.publisher.Publisher` puts it in confirm mode and publishes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import pika
import pika.exceptions
from pika.adapters.select_connection import SelectConnection

from drain.broker.broker_list import Broker, BrokerList
from drain.broker.corked import CorkedTransport, CorkingIOServices
from drain.errors import BrokerRefused, BrokerUnavailable
from drain.settings.urls import scrub

#: Named for the publisher: these log lines said "drain.broker.publisher" before this
#: module was split from it, and operators' filters may rely on that.
log = logging.getLogger("drain.publisher")


class AmqpLink:
    """One AMQP connection and one channel, opened and turned on demand.

    ``parameters`` are one broker's (shown as ``display_url``), or a list of
    brokers to fail over between (each shown as its masked URL).
    """

    def __init__(
        self,
        parameters: pika.ConnectionParameters | BrokerList,
        *,
        display_url: str,
        connect_timeout: float = 10.0,
        secrets: list[str] | None = None,
    ) -> None:
        #: The brokers this link connects to (drain.broker.broker_list).
        self.brokers = (parameters if isinstance(parameters, BrokerList)
                        else BrokerList.single(parameters, display_url))
        self._parameters = self.brokers.current.parameters
        self._secrets = [*(secrets or []), *self.brokers.secrets]
        self._display_url = self.brokers.current.shown
        self._connect_timeout = connect_timeout
        self._conn: SelectConnection | None = None
        #: The connection's I/O services (drain.broker.corked): its transport can be corked.
        self._io: CorkingIOServices | None = None
        self._channel: Any = None
        self._ready = False
        self._failure: str | None = None
        #: The broker stopped answering this connection: :meth:`close` drops it
        #: without waiting for a close-ok that would not come either.
        self._stuck = False
        self._refused = False
        self._done: Callable[[], bool] = lambda: True
        #: Why the broker blocks this connection (a resource alarm), or None.
        self.blocked: str | None = None
        self._blocked_since = 0.0
        #: When the broker last lifted a block (monotonic): what was in flight had
        #: no confirm meanwhile, and its confirm timeout counts from then.
        self.unblocked_at = 0.0

    # -- connection -----------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._ready and self._failure is None

    @property
    def broker(self) -> str:
        """The masked URL of the broker connected to (or tried last)."""
        return self._display_url

    def connect(self) -> None:
        """Open the connection and a ready channel to a broker of the list, or raise
        BrokerUnavailable (BrokerRefused when every broker refused the login).

        One pass over the list (drain.broker.broker_list says in which order), without
        waiting between brokers: the first that lets us in is used.
        """
        failures: list[BrokerUnavailable] = []
        for broker in self.brokers.attempts():
            try:
                self._connect_to(broker)
            except BrokerUnavailable as exc:
                self.brokers.failed(broker)
                failures.append(exc)
                continue
            self.brokers.connected(broker)
            self._say_connected(broker, failures)
            return
        if len(failures) == 1:
            raise failures[0]
        text = f"all {len(failures)} brokers failed: " + "; ".join(map(str, failures))
        if all(isinstance(exc, BrokerRefused) for exc in failures):
            raise BrokerRefused(text)
        raise BrokerUnavailable(text)

    def _say_connected(self, broker: Broker, failures: list[BrokerUnavailable]) -> None:
        n = len(self.brokers)
        if n == 1:
            return  # the drain says "broker connected"; the start-up line named it
        if failures:
            log.warning("%s; failed over to broker at %s (%d of %d)",
                        "; ".join(map(str, failures)), broker.shown, broker.position, n)
        else:
            log.info("connected to broker at %s (%d of %d)", broker.shown, broker.position, n)

    def _connect_to(self, broker: Broker) -> None:
        """Open the connection and a ready channel to one broker, or raise BrokerUnavailable."""
        self.close()
        self._parameters = broker.parameters
        self._display_url = broker.shown
        self._ready = False
        self._failure = None
        self._refused = False
        self._new_connection()
        self.blocked = None  # a new connection starts unblocked; the broker says if not
        try:
            self._io = CorkingIOServices()
            self._conn = SelectConnection(
                self._parameters,
                on_open_callback=self._on_connection_open,
                on_open_error_callback=self._on_connection_open_error,
                on_close_callback=self._on_connection_closed,
                custom_ioloop=self._io,
            )
            self._conn.add_on_connection_blocked_callback(self._on_blocked)
            self._conn.add_on_connection_unblocked_callback(self._on_unblocked)
        except Exception as exc:
            raise BrokerUnavailable(f"broker at {self._display_url}: {self._text(exc)}") from None
        # pika gives up after its stack timeout (broker_connection_timeout); wait as long.
        limit = max(self._connect_timeout, self._parameters.stack_timeout or 0.0)
        finished = self._run_until(lambda: self._ready or self._failure is not None, limit)
        if not self._ready:
            reason = self._failure or ("timed out" if not finished else "closed")
            refused = self._refused
            self.close()
            if refused:
                raise BrokerRefused(f"broker at {self._display_url} refused us: {reason}")
            raise BrokerUnavailable(f"broker at {self._display_url} unreachable: {reason}")

    def close(self) -> None:
        """Close the connection (if any); never raises."""
        transport = self.transport
        conn, self._conn = self._conn, None
        stuck, self._stuck = self._stuck, False
        self._io = None
        self._channel = None
        self._ready = False
        self.blocked = None  # a block belongs to its connection
        if conn is None:
            return
        try:
            if conn.is_open:
                if stuck and transport is not None:
                    # pika reports the connection lost at the next turn of its loop.
                    transport.drop(ConnectionAbortedError("the broker answered nothing"))
                else:
                    conn.close()
                deadline = time.monotonic() + 2.0
                while not conn.is_closed and time.monotonic() < deadline:
                    handle = conn.ioloop.call_later(0.05, conn.ioloop.stop)
                    conn.ioloop.start()
                    conn.ioloop.remove_timeout(handle)
        except Exception:
            log.debug("error while closing the broker connection", exc_info=True)
        try:
            conn.ioloop.close()
        except Exception:
            log.debug("error while closing the broker I/O loop", exc_info=True)

    def pump(self, seconds: float = 0.0) -> None:
        """Turn the I/O loop for up to ``seconds``: heartbeats, close notices."""
        if self._conn is None:
            return
        self._turn(seconds)
        self._raise_if_failed()

    def serve(self) -> None:
        """Turn the I/O loop once, without waiting and without raising: heartbeats
        and confirms while the drain's loop waits for something else (a Postgres
        command, drain.postgres.session). A failure is raised by the next pump, wait
        or publish."""
        if self._conn is None or self._failure is not None:
            return
        try:
            self._turn(0.0)
        except Exception:
            log.debug("error while serving the broker connection", exc_info=True)

    # -- what a subclass adds -------------------------------------------------

    def _new_connection(self) -> None:
        """Forget what belonged to the previous connection (called by :meth:`connect`)."""

    def _prepare_channel(self, channel: Any) -> None:
        """Set up a newly opened channel, then call :meth:`_on_channel_ready`.

        A plain channel is ready at once; a subclass may first put it in
        confirm mode, say, and call :meth:`_on_channel_ready` when the broker
        agreed."""
        self._on_channel_ready(None)

    def _channel_refused(self, _exc: BaseException) -> bool:
        """The channel closed: True when a subclass takes it in hand (the broker
        refused something on it and the connection is fine); else the link fails."""
        return False

    def _on_channel_ready(self, _frame: Any) -> None:
        self._ready = True
        self._wake()

    # -- pika callbacks ----------------------------------------------------------

    def _on_connection_open(self, conn: SelectConnection) -> None:
        conn.channel(on_open_callback=self._on_channel_open)

    def _on_connection_open_error(self, _conn: SelectConnection, exc: BaseException) -> None:
        self._failure = self._text(exc)
        self._refused = _is_refusal(exc)
        self._wake()

    def _on_connection_closed(self, _conn: SelectConnection, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = self._text(exc)
        self._ready = False
        self._unblock_lost()
        self._wake()

    def _on_blocked(self, _conn: Any, frame: Any) -> None:
        self._set_blocked(str(getattr(frame.method, "reason", "") or "a resource alarm"))
        self._wake()

    def _on_unblocked(self, _conn: Any, _frame: Any) -> None:
        self._set_blocked(None)
        self._wake()

    def _set_blocked(self, reason: str | None) -> None:
        """Note (and say once) that the broker blocks or unblocks this connection."""
        if reason is not None and self.blocked is None:
            self._blocked_since = time.monotonic()
            log.warning("broker at %s blocks publishing: %s (a resource alarm); waiting for "
                        "it to clear, jobs stay staged", self._display_url, reason)
        elif reason is None and self.blocked is not None:
            self.unblocked_at = time.monotonic()
            log.warning("broker at %s unblocked after %.1fs: publishing again",
                        self._display_url, time.monotonic() - self._blocked_since)
        self.blocked = reason

    def _unblock_lost(self) -> None:
        """The connection failed, and its block ends with it (``drain_broker_blocked``
        returns to 0): the failure says how long the broker had blocked it."""
        if self.blocked is not None and self._failure is not None:
            self._failure += (f" (it had blocked publishing for "
                              f"{time.monotonic() - self._blocked_since:.1f}s)")
        self.blocked = None

    def _on_channel_open(self, channel: Any) -> None:
        self._channel = channel
        channel.add_on_close_callback(self._on_channel_closed)
        self._prepare_channel(channel)

    def _on_channel_closed(self, _channel: Any, exc: BaseException) -> None:
        if self._channel_refused(exc):
            return
        if self._failure is None:
            self._failure = self._text(exc)
        self._ready = False
        self._wake()

    # -- the I/O loop ------------------------------------------------------------

    def _wake(self) -> None:
        if self._done() and self._conn is not None:
            self._conn.ioloop.stop()

    @property
    def transport(self) -> CorkedTransport | None:
        """The open connection's transport (drain.broker.corked), or None."""
        return self._io.transport if self._io is not None and self._conn is not None else None

    def _turn(self, seconds: float) -> None:
        """Turn the I/O loop once (writes, confirms, heartbeats), for up to ``seconds``."""
        self._run_until(lambda: self._failure is not None, seconds, run_once=True)

    def _run_until(
        self, done: Callable[[], bool], timeout: float, *, run_once: bool = False
    ) -> bool:
        """Turn the I/O loop until ``done()`` or ``timeout``; True when done."""
        conn = self._conn
        if conn is None:
            return done()
        self._done = done
        ioloop = conn.ioloop
        deadline = time.monotonic() + timeout
        try:
            while not done():
                remaining = deadline - time.monotonic()
                if remaining <= 0 and not run_once:
                    return False
                handle = ioloop.call_later(max(remaining, 0.0), ioloop.stop)
                try:
                    ioloop.start()
                finally:
                    ioloop.remove_timeout(handle)
                if run_once:
                    break
            return done()
        finally:
            self._done = lambda: True

    def _text(self, exc: BaseException) -> str:
        return scrub(_describe(exc), self._secrets)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            self._unblock_lost()
            failure = self._failure
            self.close()
            self._failure = None
            raise BrokerUnavailable(f"broker at {self._display_url}: {failure}")


def _innermost(exc: BaseException) -> BaseException:
    """The error pika's connection workflow wrapped: the last attempt's cause."""
    nested = getattr(exc, "exceptions", None)  # AMQPConnectionWorkflowFailed
    if nested:
        return _innermost(nested[-1])
    inner = getattr(exc, "exception", None)  # AMQPConnector*Error
    if isinstance(inner, BaseException):
        return _innermost(inner)
    return exc


def _is_refusal(exc: BaseException) -> bool:
    """A login or vhost refusal, as opposed to a network problem."""
    return isinstance(
        _innermost(exc),
        (pika.exceptions.ProbableAuthenticationError, pika.exceptions.ProbableAccessDeniedError),
    )


def _describe(exc: BaseException) -> str:
    """A short description of a pika error (callers scrub secrets from it)."""
    exc = _innermost(exc)
    if isinstance(
        exc, (pika.exceptions.ChannelClosedByBroker, pika.exceptions.ConnectionClosedByBroker)
    ):
        return f"{exc.reply_code} {exc.reply_text}"
    if isinstance(exc, pika.exceptions.ProbableAuthenticationError):
        return "login refused (check the user name and password)"
    if isinstance(exc, pika.exceptions.ProbableAccessDeniedError):
        return "access refused (check the vhost and the user's permissions)"
    if isinstance(exc, pika.exceptions.AMQPConnectionError) and exc.args:
        inner = exc.args[0]
        if isinstance(inner, BaseException):
            return _describe(inner)
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
