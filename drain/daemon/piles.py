"""Held rows that stay staged without taxing every fetch (issue 36, "piles").

With ``--app``, rows staged without a queue (or with one the app re-routes)
can go to a queue the broker refuses. They cannot be left out of the fetch by
their staged queue (it holds the good rows too), so the pipeline holds them
out by id (drain.daemon.holds, ``Holds.rows``). Sending every held id with
every fetch made each fetch step over the whole pile and plan a filter of that
many ids: 73-116 ms to plan and 22-54 ms to run with 50,000 held rows, and the
pile was walked again each time its queue's pause ran out.

What this module does instead:

0. **A static app's rows are held by route.** When the app routes by task
   name and staged queue only (plain ``task_routes`` mappings:
   ``AppRouter.static``), every row of a route to a paused queue goes there:
   :class:`HeldKeys` keeps the route (:func:`route_key`), and the fetch and the
   look leave out the rows of those routes (``held_routes``), as they leave
   out a paused staged queue's. From the first batch that held some, the pile
   is neither fetched nor walked again, and the marks pass it at the next look.
   A router function that routes the route's rows without looking at their
   arguments (asked with stand-ins, drain.celery.stand_in) holds them by
   route too (:func:`uniform_routes`), so long as every row of that route in
   the batch went to the same key; it is asked again every RECHECK seconds
   while they are held (:meth:`HeldKeys.recheck`), and a changed answer lets
   the route's rows be fetched and routed again. A router function that looks
   at the arguments holds its rows by id, as below.
1. **The marks pass held rows.** :class:`HeldKeys` remembers the key
   ``(priority, xact, id)`` of each held ready row. The look at the heads
   (``fetch_heads``) steps over the held rows not yet passed, as it steps over
   the paused staged queues' rows, and the queues they go to count among the
   queues the marks skipped (drain.postgres.keyset, "Paused queues"): the
   moment one of those is no longer paused, every mark goes back to the start
   and the held rows are fetched again. A batch that held rows brings the next
   look forward, so the pile is passed right after it was walked once.
2. **Only the held rows above the marks are sent.** A held row below its
   priority's mark cannot be fetched anyway: :meth:`HeldKeys.held_out` leaves
   it out of the fetch's exclusion list, which so holds the rows held since
   the last look (about a batch), not the pile. Rows held without a key (a
   nack, a return, a delayed row) are always sent, as before.
3. **A pause that runs out is tried by a declare** (:func:`try_due`), with
   ``--app`` as without it: while the broker still refuses the queue, it is
   paused again and its held rows stay held, behind the marks; the pile is
   walked again only once the queue is accepted, to publish it.

:func:`try_due` runs before the batch's transaction (drain.daemon.pipeline), declares at
most DUE_PER_CYCLE queues per cycle, and a queue still refused is paused
again with a jittered backoff (drain.daemon.holds): queues refused together do not
stay due together, and a healthy queue's batch never waits behind a thousand
declares. For the same reason a batch starts its new queues' declares for at
most DECLARE_BUDGET seconds; the rows of the queues it did not get to stay
staged for the next batches (pipeline ``_start``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from drain.broker.outgoing import PauseKey
from drain.broker.publisher import Publisher
from drain.celery.routing import AppRouter
from drain.daemon.holds import MAX_PAUSE, Holds
from drain.errors import BrokerBlocked
from drain.postgres import keyset
from drain.postgres.rows import StagedRow

#: At most this many paused queues are declared again per cycle; the rest stay
#: due for the next cycles. A declare is one round trip (more with bindings), and
#: they go DECLARE_CHANNELS at a time (drain.broker.queue_declare).
DUE_PER_CYCLE = 32
#: Seconds of queue declares a batch may start before it publishes: the rows of
#: the queues left undeclared stay staged for the next batches, which declare
#: them in turn. 1,000 new queues the broker refuses, one batch's worth, took
#: 1.5 s to declare one after the other (each refusal closes its declare channel:
#: two round trips more; they now go DECLARE_CHANNELS at a time,
#: drain.broker.queue_declare), and held up every other queue's rows meanwhile.
#: Not much less: each batch fetches the undeclared queues' rows again, so a
#: tight budget walks a pile of new queues many times (bench_curves, curve
#: refused: 1,000 refused queues staged before 20,000 good jobs, the good jobs'
#: rate 0.28 x with 0.05 s, 0.40-0.46 x with 0.25-0.5 s, as before the budget;
#: declared one at a time).
DECLARE_BUDGET = 0.25
#: Queues named in one warning for many refused alike.
SHOWN = 5
#: Seconds between two asks of a router function whether the routes it holds by
#: route (:func:`uniform_routes`) still go where they did.
RECHECK = 1.0
#: Seconds between two chunks of due queues.
DEFER = 0.05
#: A queue refused again is paused for its backoff less up to this fraction of it.
JITTER = 0.25


class HeldKeys:
    """The index keys of the held ready rows, to tell which ones the marks passed."""

    def __init__(self) -> None:
        #: row id -> (priority, xact, id) of a held ready row.
        self.keys: dict[int, tuple[int, int, int]] = {}
        #: The held rows above the marks, as last sent with a fetch (for the look).
        self.above: list[int] = []
        #: A static app's routes to paused keys: route key (:func:`route_key`) -> pause key.
        self.routes: dict[str, PauseKey] = {}
        #: The route keys whose queue is paused now, as last sent with a fetch.
        self.held_routes: list[str] = []
        #: Held rows the marks passed, set aside (out of ``Holds.rows``) until the
        #: marks go back: row id -> (its pause key, its index key). A cycle then
        #: looks only at the rows held since the marks last passed some, not the pile.
        self.passed: dict[int, tuple[PauseKey, tuple[int, int, int]]] = {}
        #: The routes held on a router function's answer (:func:`uniform_routes`),
        #: asked again by :meth:`recheck`: route key -> (task name, staged queue
        #: or None, the ids held by that route).
        self.asked: dict[str, tuple[str, str | None, list[int]]] = {}
        self._asked_at = 0.0
        #: The marks as the last held_out saw them: priority -> (xact, id).
        self._marks: dict[int, tuple[int, int]] = {}

    def hold(self, row: StagedRow, key: PauseKey, *, by_route: bool = False,
             asked: bool = False) -> None:
        """``row`` is held out of the fetch for ``key``; a ready row's index key is
        remembered. ``by_route``: every row of that route goes to ``key``
        (:func:`uniform_routes`) and is held; ``asked``: a router function said so,
        and is asked again (:meth:`recheck`)."""
        if by_route:
            name = route_key(row)
            self.routes[name] = key
            if asked:
                entry = self.asked.setdefault(
                    name, (row.task_name, None if row.unrouted else row.queue, []))
                entry[2].append(row.id)
        if row.ready:
            self.keys[row.id] = (row.priority, row.xact, row.id)
        else:
            self.keys.pop(row.id, None)

    def held_out(self, holds: Holds, plan: keyset.FetchPlan) -> list[int]:
        """The held rows the fetch must leave out: those whose queue is paused now
        (:meth:`Holds.held_rows`), less the ready ones below their priority's mark
        in ``plan`` (the marks passed them). Also kept as :attr:`above`.

        A row the marks passed is set aside (:attr:`passed`), out of
        ``Holds.rows``, so that each cycle looks at the rows held since, not at
        the whole pile (100,000 held rows were two passes per cycle); when a
        mark goes back, the rows set aside come back to ``Holds.rows`` (those
        whose key is still paused) and are looked at again."""
        marks = dict(zip(plan.priorities, plan.marks, strict=True))
        if self.passed and any(marks.get(p, (0, 0)) < mark for p, mark in self._marks.items()):
            self._restore(holds)
        self._marks = marks
        held = holds.held_rows()
        now = time.monotonic()
        self.routes = {k: q for k, q in self.routes.items() if q in holds.paused}
        if self.asked:
            self.asked = {k: a for k, a in self.asked.items() if k in self.routes}
        self.held_routes = [k for k, q in self.routes.items() if holds.paused[q][0] > now]
        keys = self.keys
        if len(keys) > len(holds.rows):
            self.keys = keys = {i: k for i, k in keys.items() if i in holds.rows}
        out = []
        for row_id in held:
            key = keys.get(row_id)
            mark = marks.get(key[0]) if key is not None else None
            if key is None or mark is None or (key[1], key[2]) >= mark:
                out.append(row_id)
            else:
                self.passed[row_id] = (holds.rows.pop(row_id), keys.pop(row_id))
        self.above = out
        return out

    def recheck(self, router: AppRouter, holds: Holds) -> bool:
        """Ask the router again, at most every RECHECK seconds, where each route it
        holds by route (:attr:`asked`) goes. A route it now sends elsewhere, or
        no longer routes without looking at the arguments, is let go with the
        rows held by it; True then: the marks must go back to the start, to
        fetch the rows they passed."""
        now = time.monotonic()
        if not self.asked or now - self._asked_at < RECHECK:
            return False
        self._asked_at = now
        changed = False
        for name, (task, queue, ids) in list(self.asked.items()):
            key = self.routes[name]  # (held_out forgets both when the key is resumed)
            where = router.uniform(task, queue)
            if where is not None and PauseKey.of(
                    where.queue, where.exchange, where.routing_key) == key:
                continue
            del self.routes[name], self.asked[name]
            changed = True
            for row_id in ids:
                if holds.rows.get(row_id) == key:
                    del holds.rows[row_id]
                self.keys.pop(row_id, None)
                self.passed.pop(row_id, None)
        return changed  # (held_out, next, sends the routes left with the fetch)

    def _restore(self, holds: Holds) -> None:
        """A mark went back: the rows set aside are held again, those whose key is
        still paused (a resumed key's rows are fetched and published)."""
        for row_id, (key, index) in self.passed.items():
            if key in holds.paused and row_id not in holds.rows:
                holds.rows[row_id] = key
                self.keys[row_id] = index
        self.passed.clear()


def route_key(row: StagedRow) -> str:
    """What a static app routes ``row`` by, as ``fetch_batch`` spells it (held_routes):
    its task name, US, then '*' for a row staged without a queue, else '=' and
    its queue. (A task name holding US itself could match another route's key:
    such a row would wait for that route's queue, never be lost.)"""
    return f"{row.task_name}\x1f{'*' if row.unrouted else '=' + row.queue}"


def uniform_routes(router: AppRouter,
                   targets: list[tuple[StagedRow, str, PauseKey]],
                   paused: set[PauseKey]) -> set[str]:
    """The routes (:func:`route_key`) of a batch's rows (``targets``: each row, its
    declared queue and its pause key) that can be held by route: those whose
    rows all went to one key of ``paused``, and which the app routes there
    without looking at the arguments (``AppRouter.uniform``: every route of a
    static app; with router functions, when asked with stand-ins they answer
    the same)."""
    keys: dict[str, PauseKey | None] = {}
    first: dict[str, StagedRow] = {}
    for row, _, key in targets:
        name = route_key(row)
        seen = keys.setdefault(name, key)
        if seen is not None and seen != key:
            keys[name] = None  # rows of one route that went apart: the arguments decide
        first.setdefault(name, row)
    found = set()
    for name, only in keys.items():
        if only is None or only not in paused:
            continue
        row = first[name]
        where = router.uniform(row.task_name, None if row.unrouted else row.queue)
        if where is not None and PauseKey.of(where.queue, where.exchange,
                                             where.routing_key) == only:
            found.add(name)
    return found


def try_due(holds: Holds, refusals: Refusals, publisher: Publisher) -> None:
    """Declare again up to DUE_PER_CYCLE paused queues whose pause ran out: resume
    the ones the broker accepts now, pause the others for longer. A due key with
    no queue declared (an exchange and routing key, drain.broker.outgoing.PauseKey)
    has nothing to declare: it is resumed, and its rows are fetched again.

    Trying a queue by declaring it, not by fetching its rows, keeps the marks
    past those rows (drain.postgres.keyset, "Paused queues") while the broker still
    refuses it: a fetch never steps over the pile just to find that out. The
    longest overdue go first; ``refusals`` pauses the ones refused again.
    """
    due = holds.due()
    if not due:
        return
    if len(due) > DUE_PER_CYCLE:
        order = sorted(due, key=lambda q: (holds.paused[q][0], q))
        due = set(order[:DUE_PER_CYCLE])
        # The rest stay paused a little longer, a chunk after another: a queue
        # due but not paused would send the marks back to the start.
        now = time.monotonic()
        for n, key in enumerate(order[DUE_PER_CYCLE:]):
            _, count, reason = holds.paused[key]
            holds.paused[key] = (now + DEFER * (1 + n // DUE_PER_CYCLE), count, reason)
    try:
        refused = publisher.declare({key.queue for key in due if key.queue})
    except BrokerBlocked:
        return  # tried again after the alarm
    refusals.pause(refused)
    now = time.monotonic()
    for queue in refused:
        key = PauseKey(queue)
        until, count, reason = holds.paused[key]
        # Jittered: queues refused together do not come due together again.
        jitter = random.uniform(0.0, JITTER)  # noqa: S311 (backoff, not a secret)
        holds.paused[key] = (until - jitter * (until - now), count, reason)
    holds.resume({key for key in due if key.queue not in refused})


class Refusals:
    """Pauses the queues the broker refused to declare, one warning per cause.

    A single queue is said as before (its own warning, drain.daemon.holds). Many
    refused alike (the same reply code), at once or one after another, are one
    warning for them all, naming the first few, instead of one per queue (1,000
    refused queues made 1,000 warnings): the first queue refused alone is said
    alone, and from the second one refused alike they are one cause. Such a
    queue, refused again later, stays under that one cause, reminded at most
    every REMIND_EVERY.
    """

    def __init__(self, holds: Holds, refused_reason: Callable[[str, str], str]) -> None:
        self.holds = holds
        #: ``refused_reason(queue, reply)`` says what a refused declare means (and
        #: counts it: drain.daemon.answers).
        self.refused_reason = refused_reason
        #: queue -> the cause it was said under with others.
        self.causes: dict[str, str] = {}
        #: The causes said for many queues at once: a queue refused alike later
        #: (the next batch's, say) joins its cause instead of a warning of its own.
        self.grouped: set[str] = set()
        #: cause -> the first queue refused for it alone (said with its own warning).
        self.alone: dict[str, str] = {}

    def pause(self, refused: dict[str, str]) -> None:
        """Pause each queue of ``refused`` (``{queue: the broker's reply}``)."""
        holds = self.holds
        if len(self.causes) > 2 * len(holds.paused) + 64:
            self.causes = {q: c for q, c in self.causes.items() if PauseKey(q) in holds.paused}
        codes: dict[str, list[str]] = {}
        for queue in sorted(refused):
            codes.setdefault(refused[queue].split(" ", 1)[0], []).append(queue)
        for code, queues in codes.items():
            cause = f"declare refused {code}"
            fresh = [q for q in queues if self.causes.get(q) != cause]
            reasons = {q: self.refused_reason(q, refused[q]) for q in queues}
            alone = self.alone.get(cause)
            if len(fresh) == 1 and alone is None:
                self.alone[cause] = alone = fresh[0]  # said alone (drain.daemon.holds)
            if cause not in self.grouped and fresh and fresh != [alone]:
                self.grouped.add(cause)
                members = fresh if alone is None or alone in fresh else [alone, *fresh]
                self.causes.update(dict.fromkeys(members, cause))
                shown = ", ".join(repr(q) for q in members[:SHOWN])
                more = f" and {len(members) - SHOWN} more" if len(members) > SHOWN else ""
                holds.say(cause, f"broker refused to declare {len(members)} queues ({code}): "
                                 f"{shown}{more}; their rows stay staged; retrying each with "
                                 f"backoff, up to {MAX_PAUSE:g}s apart. The first: "
                                 f"{reasons[fresh[0]]}")
            if cause in self.grouped:
                self.causes.update(dict.fromkeys(fresh, cause))
            for queue in queues:
                holds.pause(PauseKey(queue), reasons[queue], cause=self.causes.get(queue))
