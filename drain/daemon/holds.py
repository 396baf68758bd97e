"""Queues whose rows stay staged for a while, and why, said once.

The pipeline (drain.daemon.pipeline) pauses a staged queue when the broker refuses to
declare where its rows go (406, 403), returns its messages unroutable, nacks
them or refuses their publish with a code that leaves the row staged
(drain.broker.refusal): its rows are left out of the fetch with backoff, doubling from
1 s up to 30 s. The unit paused is the queue the rows go to: the fetch leaves
out the rows staged with that queue's name and, by id, the rows routed there
from another staged queue (with ``--app``, every row staged without a queue
reads as 'celery' and goes where the app routes it): a held row never holds
back another queue's rows, and a batch full of held rows never hides the rows
behind them.

Each cause is logged once, then at most every REMIND_EVERY seconds while it
lasts, however often the pause is lifted and set again: a held queue is one
warning, not one per cycle. The metrics count every refusal
(``drain_declare_refused_total{code}``, ``drain_publish_refused_total{code}``).
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("drain.pipeline")

#: The longest pause, in seconds.
MAX_PAUSE = 30.0
#: A cause already logged is logged again at most this often (seconds) while it lasts.
REMIND_EVERY = 600.0


class Holds:
    """The paused staged queues, their backoff, and what was said about them."""

    def __init__(self) -> None:
        #: queue -> (paused until (monotonic), times paused, last reason)
        self.paused: dict[str, tuple[float, int, str]] = {}
        #: queue -> consecutive holds for nacks and refusals, reset by a confirm
        #: without either.
        self._held: dict[str, int] = {}
        #: cause -> when it was last logged (monotonic).
        self._said: dict[str, float] = {}
        #: Rows held out of the fetch while the queue they go to is paused: row id
        #: -> that queue (with ``--app``, rows of one staged queue go to many).
        self.rows: dict[int, str] = {}

    def held_rows(self) -> list[int]:
        """The rows to leave out of the fetch: those whose queue is paused now.
        Rows whose queue was resumed are forgotten."""
        now = time.monotonic()
        out = []
        for row_id, queue in list(self.rows.items()):
            entry = self.paused.get(queue)
            if entry is None:
                del self.rows[row_id]
            elif entry[0] > now:
                out.append(row_id)
        return out

    def now_paused(self) -> list[str]:
        now = time.monotonic()
        return [queue for queue, (until, _, _) in self.paused.items() if until > now]

    def due(self) -> set[str]:
        """The paused queues whose pause ran out."""
        now = time.monotonic()
        return {queue for queue, (until, _, _) in self.paused.items() if until <= now}

    def pause(self, queue: str, reason: str, *, times: int = 0, cause: str | None = None) -> None:
        """Leave ``queue``'s rows staged for a while (doubling up to MAX_PAUSE, at
        least as after ``times`` pauses) and say why, once per ``cause`` (default:
        the reason; drain.daemon.piles gives many queues refused alike one cause)."""
        _, count, _ = self.paused.get(queue, (0.0, 0, ""))
        count = max(count, times)
        delay = min(2.0**count, MAX_PAUSE)
        self.paused[queue] = (time.monotonic() + delay, count + 1, reason)
        self.say(cause or reason, f"{reason}; retrying queue {queue!r} with backoff, up to "
                                  f"{MAX_PAUSE:g}s apart")

    def hold(self, queue: str, reason: str) -> None:
        """Pause ``queue`` for a publish the broker would refuse or nack again at
        once. A pause ends when the queue can be declared, which says nothing
        here: the backoff grows until a message to it is confirmed."""
        times = self._held[queue] = self._held.get(queue, 0) + 1
        self.pause(queue, reason, times=times - 1)

    def resume(self, queues: set[str]) -> None:
        for queue in queues & set(self.paused):
            del self.paused[queue]
            log.info("queue %r: publishing again", queue)

    def confirmed(self, queues: set[str]) -> None:
        """Messages to ``queues`` were confirmed without a nack or refusal: their
        hold count starts afresh."""
        for queue in queues:
            self._held.pop(queue, None)

    def say(self, cause: str, text: str) -> None:
        """Log ``text`` as a warning, unless ``cause`` was logged less than
        REMIND_EVERY seconds ago."""
        now = time.monotonic()
        last = self._said.get(cause)
        if last is not None and now - last < REMIND_EVERY:
            return
        self._said[cause] = now
        log.warning("%s", text)
