"""The publishing channel and its replacement: after a nack, after a refused
publish, and when a new channel answers nothing.

:class:`ChannelKeepingLink` keeps what :class:`drain.broker.publisher.Publisher`
has in flight on its publishing channel (drain.broker.window), and is the one
way to put a new channel in its place (:meth:`ChannelKeepingLink._reopen`): the
old channel's batches, every message of them answered or given up, leave the
window, and the old channel is closed, so that no late answer of it is taken
for one of the new channel, whose delivery tags count from 1 again. Three
things replace a channel:

* a refused publish closes it (drain.broker.refusal; the publisher sorts out
  the unconfirmed messages first);
* a nack (:meth:`ChannelKeepingLink._renew`);
* a new channel that answers nothing at all (:meth:`ChannelKeepingLink.replace_mute`,
  decided by drain.daemon.confirms).

A message given up on a replaced channel is DROPPED (drain.broker.refusal): its
row stays staged and goes out again with the same task id, as when a
connection is lost.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import pika

from drain.broker.batches import Batch
from drain.broker.broker_list import BrokerList
from drain.broker.refusal import RefusalProbingLink
from drain.broker.window import Window

log = logging.getLogger("drain.publisher")

#: How long the next batch waits for the last answers on a channel that nacked,
#: before it goes on a new one (:meth:`ChannelKeepingLink._renew`); seconds.
RENEW_WAIT = 0.25
#: How long a new channel may answer nothing at all, with messages waiting on it,
#: before the drain publishes on another (:meth:`ChannelKeepingLink.replace_mute`); seconds.
#: Each such replacement doubles it (up to the confirm timeout) until an ack comes.
MUTE_WAIT = 3.0
#: How long the channel that replaces a mute one has to open before the connection
#: counts as stuck as well (a broker that answers opens a channel in milliseconds).
MUTE_OPEN_WAIT = 1.0


class ChannelKeepingLink(RefusalProbingLink):
    """A link's publishing channel, what is in flight on it, and its replacement."""

    def __init__(self, parameters: pika.ConnectionParameters | BrokerList, *,
                 confirm_timeout: float, **link: Any) -> None:
        super().__init__(parameters, **link)
        self._confirm_timeout = confirm_timeout
        #: Batches published and not yet handed back, and the answers to them.
        self._window = Window()
        #: Counts connections: a batch of an older one is never answered again.
        self._generation = 0
        #: The broker nacked a message on the publishing channel: the next batch goes
        #: out on a new one (:meth:`_renew`).
        self._nacked = False
        #: Publishing channels replaced by :meth:`_reopen`, until their close is confirmed.
        self._retired: list[Any] = []
        #: How long the current channel may stay mute (:meth:`mute_limit`).
        self._mute_limit = MUTE_WAIT

    def _new_connection(self) -> None:
        super()._new_connection()
        self._window = Window()
        self._generation += 1
        self._nacked = False
        self._retired = []

    def _heard(self, acked: bool) -> None:
        """The publishing channel answered: an ack, or a nack (then the next batch
        goes out on a new channel)."""
        if acked:
            self._mute_limit = MUTE_WAIT
        else:
            self._nacked = True

    def _renew(self) -> None:
        """After a nack: publish the next batch on a new channel, once every message
        of the current one is answered (waiting up to :data:`RENEW_WAIT` for that;
        those still unanswered then are given up, DROPPED: their rows stay staged
        and go out again, with the same task ids).

        A nack means the queue did not take the message: a full queue with
        ``x-overflow: reject-publish``, or a quorum queue without a leader. On
        RabbitMQ 3.10 a channel opened just after a quorum queue's leader died
        gets every publish to that queue nacked until the dead node returns, while
        a new channel gets acks as soon as a new leader is elected (issue 37,
        measured on a three-node cluster). So the nacked rows, published again
        once their queue's hold runs out (drain.daemon.holds), go on a channel
        that has not nacked: a queue that is really full nacks there too and
        stays held. Such a channel answers a publish to that queue only after
        5 s (a nack), so a wait for every answer on it would never end while
        batches flow; after :data:`RENEW_WAIT` (healthy queues' confirms take
        milliseconds) what is left unanswered is given up, as when a connection
        is lost. The old channel is closed: no late answer of it can be taken
        for one of the new channel, whose delivery tags count from 1 again."""
        if self._failure is not None:
            return
        self._run_until(self._channel_answered, RENEW_WAIT)
        self._reopen("no new channel in time after a nack")

    def mute_limit(self, batch: Batch) -> float | None:
        """Seconds of silence after which :meth:`replace_mute` replaces the channel
        ``batch`` went out on, if that channel has answered nothing yet; None when it
        has, when the batch is answered, when silence is no sign of a mute channel
        (the broker blocked the connection, or the batch went out on an older
        connection), or when the confirm timeout is no longer."""
        if (self._settled() or not batch.unresolved or batch.generation != self._generation
                or self._conn is None or self._failure is not None
                or self.blocked is not None or self._mute_limit >= self._confirm_timeout):
            return None  # (a limit that long: the confirm timeout gives the batch up)
        return self._mute_limit

    def _settled(self) -> bool:
        """The current channel has answered, so its silence is a slow broker's, not a
        mute channel's. On a connection after the link's first (a failover), a
        channel must have answered for MUTE_WAIT seconds to count: one whose first
        answers came just before its quorum queue lost its leader, and which then
        fell silent, is mute all the same (tests/rabbit_cluster, a partition of the
        drain's node: one answer, then 12.7 s of silence until the partition healed)."""
        window = self._window
        if not window.heard:
            return False
        return self._generation <= 1 or window.heard_at - window.first_heard_at >= MUTE_WAIT

    def replace_mute(self, silent: float) -> None:
        """The current channel answered nothing for ``silent`` seconds since its
        first publish: publish on a new one. Its messages, all unanswered, are
        given up (DROPPED: their rows stay staged and go out again, with the same
        task ids), and the next mute channel is given twice as long.

        On RabbitMQ 3.10 a channel that first publishes to a quorum queue while
        the queue's leader is being replaced may get no answer at all for many
        seconds (17 s when the drain's own node was cut off by a partition and it
        went on through another; issue 37), while a channel opened a few seconds
        later gets acks at once. A channel that has answered once is not mute
        (after a failover: that has answered for MUTE_WAIT seconds, :meth:`_settled`):
        a slow broker's confirms come, and only the confirm timeout gives it up."""
        unanswered = sum(batch.unresolved for batch in self._window.of(self._generation))
        log.warning("broker at %s answered nothing on a new channel for %.1fs; publishing "
                    "on another (%d unanswered message(s) stay staged)",
                    self._display_url, silent, unanswered)
        self._mute_limit = min(2 * self._mute_limit, self._confirm_timeout)
        # Its connection may be as stuck as the channel (a new channel on it was seen
        # to wait 12 s for its open-ok): a new channel opens at once, or the next node.
        self._reopen(f"no new channel within {MUTE_OPEN_WAIT:g}s after a mute one",
                     MUTE_OPEN_WAIT)

    def _channel_answered(self) -> bool:
        """Every message published on the current channel was answered."""
        return self._failure is not None or self._window.answered(self._generation)

    def _on_channel_closed(self, channel: Any, exc: BaseException) -> None:
        if any(channel is old for old in self._retired):
            self._retired = [old for old in self._retired if old is not channel]
            return  # closed by _reopen, on purpose
        super()._on_channel_closed(channel, exc)

    def _reopen(self, failure: str, wait: float | None = None) -> None:
        """Publish on a new channel of the same connection (or fail the link with
        ``failure``). Delivery tags count from 1 again on it: the old channel's
        messages still unanswered are given up (DROPPED: their rows stay staged),
        and its batches leave the window, so that none takes an answer of the new
        one; the old channel, if the broker has not closed it, is closed, and its
        nacks no longer count (the new one has nacked nothing). The new channel
        has ``wait`` seconds to open (the connect timeout by default)."""
        conn = self._conn
        if conn is None or self._failure is not None:
            return
        self._window.drop_unanswered(self._generation)
        self._window.leave_channel(self._generation)
        self._nacked = False
        old, self._channel = self._channel, None
        if old is not None:
            self._retired.append(old)
            with contextlib.suppress(Exception):
                old.close()
        self._ready = False
        conn.channel(on_open_callback=self._on_channel_open)
        if not self._run_until(lambda: self._ready or self._failure is not None,
                               self._connect_timeout if wait is None else wait):
            self._failure = self._failure or failure
            self._stuck = True
