"""The plan of one interleaving of tests/integration/test_interleavings.py.

A plan is a pure function of its seed (queue names aside): which rows, how
they are staged, which transactions are held open or rolled back, and when
drains restart or a queue is deleted. tests/interleaving_support.py carries it
out.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import uuid

from tests import support

TASK = "t.interleaving"
PRIORITIES = (-10, -1, 0, 0, 0, 1, 5)
#: Rows with explicit ids: (kind, id for the row's number n); "reuse" is chosen at run time.
EXPLICIT_IDS = {
    "huge": lambda n: 10**12 + n,
    "negative": lambda n: -1 - n,
    "extreme": lambda n: -(2**63) + n if n % 2 else 2**63 - 1 - n,
}


@dataclasses.dataclass
class Row:
    """One staged row, identified by its marker (args[0] and kwargs["m"])."""

    marker: str
    queue: str
    task_id: uuid.UUID
    priority: int
    #: How it is inserted: "stage", "many" (stage_many's COPY), "sql", or an
    #: explicit id: "huge", "negative", "extreme", "reuse" (plain SQL, in a savepoint).
    method: str
    #: Staged an hour ahead, then made due by: "null", "null+priority" or "now".
    delayed: str | None = None
    #: expires_at "past" (already expired when staged) or "soon" (within ~1 s).
    expiring: str | None = None
    #: A priority the row is moved to after its commit (it may be gone by then).
    reprioritize: int | None = None
    #: Inserted in a savepoint that is rolled back.
    savepoint_rollback: bool = False
    #: Conflicting updates after its commit, one transaction each, while the drain
    #: may hold it in a batch: (pause before, time held open, rolled back). Each
    #: sets args to [marker, n] (n: its number from 1), see tests/interleaving_support.py.
    updates: list[tuple[float, float, bool]] = dataclasses.field(default_factory=list)
    # -- filled in by the writer
    id: int | None = None
    state: str = "planned"  # "committed" or "rolled back" once its transaction ended
    commit_called: float | None = None
    #: When it became due: its commit returned (a delayed row: its update's commit).
    ready_at: float | None = None
    #: A delayed row: just before the commit of the update that made it due.
    due_called: float | None = None
    #: The number of the last of ``updates`` that committed while the row was staged.
    final_version: int | None = None


@dataclasses.dataclass
class Txn:
    """One writer transaction."""

    at: float
    rows: list[Row]
    hold: float
    rollback: bool
    seed: int
    update_after: float
    update_hold: float
    #: Its rows go to the queue that is deleted: before the deletion (None), or
    #: starting this long after it.
    to_deleted: bool = False
    after_delete: float | None = None


@dataclasses.dataclass
class Event:
    at: float
    action: str  # restart, standby, takeover, delete, redeclare, reset_identity
    lane: int = 0
    #: redeclare: this long after the deletion
    after_delete: float = 0.0


@dataclasses.dataclass
class Plan:
    seed: int
    lanes: int
    batch_size: int
    lock_key: int
    activity: float
    queues: list[str]
    deleted: str | None
    txns: list[Txn]
    events: list[Event]

    @property
    def rows(self) -> list[Row]:
        return [row for txn in self.txns for row in txn.rows]

    def describe(self) -> str:
        kinds = collections.Counter(e.action for e in self.events)
        hot = [row for row in self.rows if row.updates]
        return (f"lanes={self.lanes} batch_size={self.batch_size} rows={len(self.rows)} "
                f"txns={len(self.txns)} queues={len(self.queues)} "
                f"deleted_queue={self.deleted is not None} events={dict(kinds)} "
                f"hot_rows={len(hot)} hot_updates={sum(len(r.updates) for r in hot)}")


class _Planner:
    """Draws one interleaving's transactions from its seeded generator."""

    def __init__(self, rng: random.Random, prefix: str, queues: list[str],
                 deleted: str | None) -> None:
        self.rng, self.prefix, self.queues, self.deleted = rng, prefix, queues, deleted
        self.rows: list[Row] = []

    def row(self, method: str, *, to_deleted: bool) -> Row:
        rng = self.rng
        row = Row(f"{self.prefix}{len(self.rows)}", rng.choice(self.queues),
                  uuid.UUID(int=rng.getrandbits(128), version=4), rng.choice(PRIORITIES), method)
        roll = rng.random()
        if self.deleted is not None and to_deleted:
            row.queue = self.deleted  # plain rows only: the deleted queue's rows must arrive
        elif roll < 0.1:
            row.delayed = rng.choice(["null", "null+priority", "now"])
        elif roll < 0.2:
            row.expiring = rng.choice(["past", "soon"])
        elif roll < 0.25:
            row.reprioritize = rng.choice(PRIORITIES)
        if self.rows and rng.random() < 0.08:  # two rows, one task id
            row.task_id = rng.choice(self.rows).task_id
        row.savepoint_rollback = method != "many" and rng.random() < 0.04
        self.rows.append(row)
        return row

    def txn(self, at: float, *, to_deleted: bool = False) -> Txn:
        rng = self.rng
        style = rng.choice(["stage", "many", "sql", "mixed"])
        rows = [self.row(style if style != "mixed" else rng.choice(
                    ["stage", "sql", "huge", "negative", "extreme", "reuse"]),
                         to_deleted=to_deleted)
                for _ in range(rng.randint(1, 12))]
        hold = rng.uniform(0.2, 2.0) if rng.random() < 0.25 else 0.0
        return Txn(at, rows, hold, rng.random() < 0.15, rng.randrange(2**32),
                   rng.uniform(0.1, 1.0), rng.uniform(0.2, 1.0) if rng.random() < 0.3 else 0.0,
                   to_deleted)


def make_plan(seed: int, index: int) -> Plan:
    rng = random.Random(seed)
    lanes = rng.choice([1, 1, 2, 4])
    activity = rng.uniform(1.5, 4.0)
    queues = [support.unique("drain_il") for _ in range(rng.choice([1, 2]))]
    deleted = support.unique("drain_il_del") if rng.random() < 0.5 else None
    planner = _Planner(rng, f"{index}.{seed}.", queues, deleted)
    txns = [planner.txn(rng.uniform(0, activity)) for _ in range(rng.randint(10, 40))]
    events = [Event(rng.uniform(0, activity), "restart", rng.randrange(lanes))
              for _ in range(rng.randint(0, 2))]
    if rng.random() < 0.4:
        lane, at = rng.randrange(lanes), rng.uniform(0, activity / 2)
        events += [Event(at, "standby", lane),
                   Event(at + rng.uniform(0.3, activity / 2), "takeover", lane)]
    if deleted is not None:
        at, later = rng.uniform(0.3, activity * 0.6), rng.uniform(1.0, 3.0)
        events += [Event(at, "delete"), Event(at + later, "redeclare", after_delete=later)]
        # Rows to it before its deletion, and a burst right after: published while it is gone.
        txns += [planner.txn(rng.uniform(0, at), to_deleted=True)
                 for _ in range(rng.randint(1, 3))]
        for _ in range(rng.randint(2, 5)):
            txns.append(planner.txn(at, to_deleted=True))
            txns[-1].after_delete = rng.uniform(0.0, 0.5)
    if rng.random() < 0.25:
        events.append(Event(rng.uniform(0, activity), "reset_identity"))
    _conflicting_updates(seed, txns, deleted)
    txns.sort(key=lambda t: t.at)
    events.sort(key=lambda e: e.at)
    return Plan(seed, lanes, rng.choice([1, 5, 10, 50]), rng.randrange(1, 2**62), activity,
                queues, deleted, txns, events)


def _conflicting_updates(seed: int, txns: list[Txn], deleted: str | None) -> None:
    """Give some rows conflicting updates: bursts of short transactions every few
    milliseconds, some held open a while, some rolled back. Drawn from a generator
    of their own, so that a seed's other draws are what they were before."""
    rng = random.Random(f"{seed}/updates")
    for txn in txns:
        for row in txn.rows:
            if row.delayed or row.queue == deleted or rng.random() >= 0.1:
                continue
            row.updates = [(rng.uniform(0.0, 0.01) if n else 0.0,  # the first at once
                            rng.uniform(0.02, 0.3) if rng.random() < 0.15 else 0.0,
                            rng.random() < 0.15)
                           for n in range(rng.randint(2, 20))]
