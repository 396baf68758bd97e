"""What stays staged for a while, keyed by what failed, and why, said once.

The broker refuses some of what the drain sends in ways that come again if it is
sent again at once: it refuses to declare a queue (406, 403), returns messages
unroutable, nacks them (a full queue with ``x-overflow: reject-publish``), or
refuses their publish with a code that leaves the row staged
(drain.broker.refusal). Their rows then stay staged for a while, with backoff
doubling from 1 s up to MAX_PAUSE.

One key for every pause
-----------------------
A pause is keyed by what failed, a :class:`drain.broker.outgoing.PauseKey`:

* the declared queue (with ``--app``, its declaration key), when one is
  declared for the message;
* else (with ``--app``, a route to an exchange and no queue, a ``Broadcast``)
  the exchange and routing key it went to: returns for one exchange never hold
  back the jobs routed to another.

The same key everywhere: the publisher reports nacks, returns, refusals and
confirms by it (``PublishResult.*_keys``, ``Message.pause_key``); a refused
declare pauses its queue's key; :meth:`Holds.pause`, :meth:`Holds.hold`,
:meth:`Holds.resume` and :meth:`Holds.confirmed` take it; the log lines name it
(``queue 'q'``, ``exchange 'x' routing key 'k'``). So a nack or a return pauses
only that key, the log names it, a message confirmed for it resumes it, and a
confirm without a nack or refusal in that batch resets its backoff.

A queue an operator paused (``drain pause``, drain.daemon.operators) is a key
too, paused until the operator resumes it (:meth:`Holds.operate`): its rows are
held as a refused queue's are, but no declare, confirm or backoff lifts it.

The staged queue (a row's ``queue`` column) is never a key: with ``--app`` the
rows staged without a queue all read as 'celery' and go wherever the app routes
them, to many destinations. Pausing the staged queue held back every such job
for one full queue, named the wrong queue, and never reset its backoff (a
confirm came for the declared queue).

Leaving held rows out of the fetch
----------------------------------
Each row seen going to a paused key is remembered by id (:attr:`Holds.rows`)
and left out of the fetch by id while that key is paused (:meth:`held_rows`),
so a held row never holds back the rows behind it or routed elsewhere, and a
batch full of held rows never hides the rows behind them. Without ``--app`` a
queue key is also the staged queue (the message goes to the default exchange
with the row's queue as its routing key): the fetch then also leaves that
staged queue out by name (drain.postgres.keyset, "Paused queues"). With
``--app`` nothing is left out by name, but a static app's held rows are left
out by route (task name and staged queue), and the marks pass the held rows
(drain.daemon.piles): a pile is walked once, not by every fetch. Either way a
key whose pause ran out is tried by declaring its queue again (a key with no
queue is resumed, and its rows fetched again), before the batch's transaction
and a few at a time (drain.daemon.piles.try_due).

An exchange the drain declares itself that vanishes (404 on publish) is a
``retry`` (drain.broker.refusal): declared again before the next publish, every
time, never dead-lettered. Its rows stay staged; a retry that comes again
before a confirm for that key pauses it (:meth:`Holds.retry`), so an exchange
deleted over and over costs a publish per backoff step, not a loop.

Each cause is logged once, then at most every REMIND_EVERY seconds while it
lasts, however often the pause is lifted and set again: a held queue is one
warning, not one per cycle. The metrics count every refusal
(``drain_declare_refused_total{code}``, ``drain_publish_refused_total{code}``)
and every nack and return (``drain_nacked_total``, ``drain_unroutable_total``).
"""

from __future__ import annotations

import logging
import math
import time

from drain.broker.outgoing import PauseKey

log = logging.getLogger("drain.pipeline")

#: The longest pause, in seconds.
MAX_PAUSE = 30.0
#: A cause already logged is logged again at most this often (seconds) while it lasts.
REMIND_EVERY = 600.0


class Holds:
    """The paused keys, their backoff, the rows held for them, and what was said."""

    def __init__(self) -> None:
        #: key -> (paused until (monotonic), times paused, last reason)
        self.paused: dict[PauseKey, tuple[float, int, str]] = {}
        #: key -> consecutive holds for nacks, refusals and retries, reset by a
        #: confirm without either.
        self.held: dict[PauseKey, int] = {}
        #: cause -> when it was last logged (monotonic).
        self._said: dict[str, float] = {}
        #: Rows held out of the fetch while the key they go to is paused: row id
        #: -> that key.
        self.rows: dict[int, PauseKey] = {}
        #: Queues an operator paused (drain.postgres.pauses): key -> the reason
        #: given. Paused until the operator resumes them, whatever the broker says:
        #: never due, never resumed by a declare or a confirm.
        self.operator: dict[PauseKey, str] = {}

    def held_rows(self) -> list[int]:
        """The rows to leave out of the fetch: those whose key is paused now.
        Rows whose key was resumed are forgotten."""
        now = time.monotonic()
        paused = self.paused
        # Once per key, then a pass per row in comprehensions: 100,000 held rows
        # are looked at every cycle.
        live = {key for key, entry in paused.items() if entry[0] > now}
        for row_id in [row_id for row_id, key in self.rows.items() if key not in paused]:
            del self.rows[row_id]
        return [row_id for row_id, key in self.rows.items() if key in live]

    def now_paused(self) -> list[PauseKey]:
        now = time.monotonic()
        return [key for key, (until, _, _) in self.paused.items() if until > now]

    def due(self) -> set[PauseKey]:
        """The paused keys whose pause ran out."""
        now = time.monotonic()
        return {key for key, (until, _, _) in self.paused.items() if until <= now}

    def operate(self, keys: dict[PauseKey, str]) -> None:
        """The queues operators pause now (``{key: reason}``, all of them): pause the
        new ones until further notice, and let go of the others (their rows are
        fetched again once the marks see them no longer paused)."""
        for key in sorted(keys.keys() - self.operator.keys()):
            count = self.paused.get(key, (0.0, 0, ""))[1]
            self.paused[key] = (math.inf, count, keys[key])
            log.warning("%s: publishing paused by an operator (%s); its jobs stay staged "
                        "until `drain resume`", key, keys[key])
        resumed = self.operator.keys() - keys.keys()
        for key in sorted(resumed):
            self.paused.pop(key, None)
            log.warning("%s: publishing resumed by an operator", key)
        self.operator = dict(keys)

    def pause(self, key: PauseKey, reason: str, *, times: int = 0,
              cause: str | None = None) -> None:
        """Leave ``key``'s rows staged for a while (doubling up to MAX_PAUSE, at
        least as after ``times`` pauses) and say why, once per ``cause`` (default:
        the reason; drain.daemon.piles gives many queues refused alike one cause).
        A queue an operator paused stays paused as it is."""
        if key in self.operator:
            return
        _, count, _ = self.paused.get(key, (0.0, 0, ""))
        count = max(count, times)
        delay = min(2.0**count, MAX_PAUSE)
        self.paused[key] = (time.monotonic() + delay, count + 1, reason)
        self.say(cause or reason, f"{reason}; retrying {key} with backoff, up to "
                                  f"{MAX_PAUSE:g}s apart")

    def hold(self, key: PauseKey, reason: str) -> None:
        """Pause ``key`` for a publish the broker would refuse or nack again at
        once. A pause ends when the queue can be declared, which says nothing
        here: the backoff grows until a message to it is confirmed.

        A nack or return for a message published before ``key``'s pause began
        (still in flight when the first came back) leaves that pause as it is:
        the backoff grows only with each try after a pause ran out, not with
        the size of the window in flight when a queue first nacked."""
        if self._pausing(key):
            return
        times = self.held[key] = self.held.get(key, 0) + 1
        self.pause(key, reason, times=times - 1)

    def retry(self, key: PauseKey, reason: str) -> None:
        """``key``'s publish was refused in a way a redeclare cures: publish again
        at once the first time, with backoff (as :meth:`hold`) when it comes again
        before a message to ``key`` was confirmed (a pause under way stands, as in
        :meth:`hold`)."""
        if self._pausing(key):
            return
        times = self.held[key] = self.held.get(key, 0) + 1
        if times > 1:
            self.pause(key, reason, times=times - 2)
        else:
            self.say(reason, f"{reason}; declaring {key} again")

    def _pausing(self, key: PauseKey) -> bool:
        entry = self.paused.get(key)
        return entry is not None and entry[0] > time.monotonic()

    def resume(self, keys: set[PauseKey]) -> None:
        """The broker takes ``keys`` again (not those an operator paused)."""
        for key in sorted((keys & set(self.paused)) - set(self.operator)):
            del self.paused[key]
            log.info("%s: publishing again", key)

    def confirmed(self, keys: set[PauseKey]) -> None:
        """Messages to ``keys`` were confirmed without a nack or refusal: their
        hold count starts afresh."""
        for key in keys:
            self.held.pop(key, None)

    def say(self, cause: str, text: str) -> None:
        """Log ``text`` as a warning, unless ``cause`` was logged less than
        REMIND_EVERY seconds ago."""
        now = time.monotonic()
        last = self._said.get(cause)
        if last is not None and now - last < REMIND_EVERY:
            return
        self._said[cause] = now
        log.warning("%s", text)
