"""The workload of tests/integration/test_interleavings.py: the writers that
carry out a seeded plan (tests/interleaving_plan.py), a consumer that records
every delivery, and drains started and stopped per interleaving.

Timing between threads is not reproducible; the workload is.
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import threading
import time
from typing import Any

import pika
import pika.exceptions
import psycopg

import drain
from drain.daemon.runner import State
from drain.settings.config import Settings
from tests import roles, support
from tests.deliveries import ConsumerThread
from tests.integration.conftest import Running
from tests.interleaving_plan import EXPLICIT_IDS, PRIORITIES, TASK, Plan, Row, Txn

# -- the consumer --------------------------------------------------------------------


class Consumer(ConsumerThread):
    """Consumes every queue (auto-ack) on its own thread and records each delivery.

    A queue deleted on the broker cancels its consumer; it is subscribed again
    as soon as the queue exists again.
    """

    def __init__(self, queues: list[str]) -> None:
        super().__init__(queues, "il-consumer")
        #: marker -> when it was first received (time.monotonic())
        self.first: dict[str, float] = {}
        #: marker -> (headers["id"], correlation_id) of every copy received
        self.copies: dict[str, list[tuple[str, str]]] = collections.defaultdict(list)
        #: marker -> the version (args[1]) of every copy of an updated row received
        self.versions: dict[str, list[int]] = collections.defaultdict(list)
        #: queue -> messages received from it
        self.per_queue: collections.Counter[str] = collections.Counter()
        self.malformed: list[str] = []
        self.live: set[str] = set()
        #: queue -> the channel consuming it
        self._channels: dict[str, Any] = {}

    def _on_message(self, _ch: Any, method: Any, props: Any, body: bytes) -> None:
        now = time.monotonic()
        self.per_queue[str(method.routing_key)] += 1
        try:
            args, kwargs, _embed = json.loads(body)
            marker = str(args[0])
        except (ValueError, TypeError, IndexError, KeyError) as exc:
            self.malformed.append(f"{body[:200]!r}: {exc}")
            return
        if kwargs != {"m": marker}:
            self.malformed.append(f"{body[:200]!r}: kwargs do not match args")
        self.first.setdefault(marker, now)
        if len(args) > 1:
            self.versions[marker].append(int(args[1]))
        headers = props.headers or {}
        self.copies[marker].append((str(headers.get("id")), str(props.correlation_id)))

    def _turn(self, conn: Any) -> None:
        for queue in self.queues:
            self._subscribe(conn, self._channels, queue)

    def _subscribe(self, conn: Any, channels: dict[str, Any], queue: str) -> None:
        ch = channels.get(queue)
        if ch is not None and ch.is_open and ch.consumer_tags:
            return
        self.live.discard(queue)
        if ch is None or not ch.is_open:
            ch = channels[queue] = conn.channel()
        try:
            ch.queue_declare(queue, passive=True)
            ch.basic_consume(queue, self._on_message, auto_ack=True)
        except pika.exceptions.ChannelClosedByBroker:  # 404: deleted, not declared again yet
            channels.pop(queue, None)
            return
        self.live.add(queue)


def declare(queue: str) -> None:
    """Declare a queue as the drain does (durable, no arguments)."""
    with support.broker_channel() as ch:
        ch.queue_declare(queue, durable=True)


def delete_when_empty(queue: str, timeout: float = 5.0) -> bool:
    """Delete ``queue`` if it holds no message (if-empty, retried until ``timeout``):
    a guard that the deletion destroys no message the drain had confirmed."""
    deadline = time.monotonic() + timeout
    with support.broker_channel() as first:
        ch = first
        while True:
            try:
                ch.queue_delete(queue, if_empty=True)
            except pika.exceptions.ChannelClosedByBroker:  # 406: not empty right now
                if time.monotonic() > deadline:
                    return False
                ch = ch.connection.channel()
                time.sleep(0.005)
            else:
                return True


# -- drains --------------------------------------------------------------------------


class Fleet:
    """The drains of one interleaving: one per lane, plus standbys; all share a lock key."""

    def __init__(self, db_url: str, plan: Plan) -> None:
        self.db_url = db_url
        self.plan = plan
        self.drains: list[tuple[int, Running]] = []
        #: every drain started, stopped ones too
        self.every: list[Running] = []

    def start(self, lane: int) -> Running:
        # The drains run as the drain's least-privileged role; the writers, which also
        # read back ids, update rows and reset the identity, as the test's owner.
        settings = Settings(
            database_url=roles.url(self.db_url, roles.RUNNER), broker_url=support.BROKER_URL,
            poll_interval=0.2, max_backoff=0.5, rescan_interval=0.0,
            batch_size=self.plan.batch_size,
            lock_key=self.plan.lock_key, lanes=self.plan.lanes, lane=lane)
        running = Running(settings)
        self.drains.append((lane, running))
        self.every.append(running)
        return running

    def total(self, sample: str) -> int:
        """A counter summed over every drain started (e.g. drain_unroutable_total)."""
        return int(sum(r.drain.metrics.registry.get_sample_value(sample) or 0.0
                       for r in self.every))

    def all_lanes_active(self) -> bool:
        active = {lane for lane, r in self.drains if r.drain.state is State.ACTIVE}
        return active == set(range(self.plan.lanes))

    def stop_one(self, lane: int) -> None:
        """Stop the lane's active drain (a standby of the lane, if any, takes over)."""
        mine = [r for ln, r in self.drains if ln == lane]
        deadline = time.monotonic() + 5
        while not (active := [r for r in mine if r.drain.state is State.ACTIVE]):
            if time.monotonic() > deadline:
                active = mine
                break
            time.sleep(0.02)
        victim = active[0]
        self.drains.remove((lane, victim))
        victim.stop()

    def restart(self, lane: int) -> None:
        self.stop_one(lane)
        self.start(lane)

    def takeover(self, lane: int) -> None:
        if sum(1 for ln, _ in self.drains if ln == lane) > 1:
            self.stop_one(lane)
        else:
            self.restart(lane)

    def stop_all(self) -> None:
        errors = []
        for _, running in self.drains:
            try:
                running.stop()
            except AssertionError as exc:
                errors.append(exc)
        self.drains = []
        if errors:
            raise errors[0]


# -- writers -------------------------------------------------------------------------


def reset_identity(db_url: str) -> bool:
    """``ALTER TABLE ... RESTART WITH 1``: waits for open writers (lock_timeout 5 s);
    False if it gave up waiting."""
    try:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute("ALTER TABLE staged_jobs ALTER COLUMN id RESTART WITH 1")
    except (psycopg.errors.LockNotAvailable, psycopg.errors.DeadlockDetected):
        return False
    return True


_SQL_INSERT = (
    "INSERT INTO staged_jobs ({id}task_id, task_name, args, kwargs, queue, priority, "
    "not_before, expires_at) {overriding}VALUES ({value}%s, %s, %s, %s, %s, %s, "
    "now() + make_interval(secs => %s), now() + make_interval(secs => %s))"
)


def _expires(row: Row, rng: random.Random) -> float | None:
    if row.expiring == "past":
        return -rng.uniform(1.0, 60.0)
    if row.expiring == "soon":
        return rng.uniform(0.05, 1.0)
    return None


class Writer:
    """Carries out the plan's transactions (one thread each, from a pool)."""

    def __init__(self, db_url: str, plan: Plan, consumer: Consumer, start: float) -> None:
        self.db_url = db_url
        self.plan = plan
        self.consumer = consumer
        self.start = start
        #: set once the queue to delete was deleted (or its deletion gave up)
        self.deleted = threading.Event()
        #: Set when its deletion begins: transactions to it wait for the deletion since.
        self.deleting = False
        self._gate = threading.Lock()
        self._to_deleted = 0  # transactions to that queue under way before its deletion
        #: ids given again to a new row after their first row was delivered
        self.reused = 0
        #: transactions rolled back by a unique violation (an identity reset's ids)
        self.collisions = 0
        #: conflicting updates committed while their row was staged
        self.updated = 0
        #: what went wrong that is the drain's doing, seen by the writers
        self.problems: list[str] = []

    def run(self, txn: Txn) -> None:
        rng = random.Random(txn.seed)
        time.sleep(max(0.0, self.start + txn.at - time.monotonic()))  # the workload's pace
        entered = txn.to_deleted and txn.after_delete is None and self._enter()
        if txn.to_deleted and not entered:
            self.deleted.wait(30)
            time.sleep(txn.after_delete or 0.0)  # the workload's pace
        conn = psycopg.connect(self.db_url)
        try:
            try:
                self._insert(conn, txn, rng)
                time.sleep(txn.hold)  # a transaction held open
                if txn.rollback:
                    conn.rollback()
                    self._ended(txn.rows, committed=False)
                    return
                called = time.monotonic()
                conn.commit()
            except (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected):
                # An identity reset's id is still staged, or being staged by another
                # writer that waits for one of ours: the writers' own collision.
                conn.rollback()
                self.collisions += 1
                self._ended(txn.rows, committed=False)
                return
            self._ended(txn.rows, committed=True, called=called, done=time.monotonic())
            self._update(conn, txn, rng)
            self._conflicting_updates(conn, txn)
        finally:
            conn.close()
            if entered:
                with self._gate:
                    self._to_deleted -= 1

    def _enter(self) -> bool:
        with self._gate:
            if self.deleting:
                return False
            self._to_deleted += 1
            return True

    def quiesce(self, queue: str, timeout: float = 15.0) -> bool:
        """Stop new transactions to ``queue``, and wait until nothing can be in flight to
        it: its transactions ended, each committed row delivered, none staged.

        RabbitMQ confirms a message whose queue is deleted while the message is being
        routed to it (rabbit_channel: "Deleted queue is a special case. Do not nack"):
        the drain is told the message arrived, deletes its row, and the message is gone.
        No publisher can tell; the test deletes the queue only when nothing is in flight.
        """
        with self._gate:
            self.deleting = True
        mine = [r for r in self.plan.rows if r.queue == queue]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            while time.monotonic() < deadline:
                if self._to_deleted == 0 and all(
                        r.marker in self.consumer.first for r in mine if r.state == "committed"):
                    row = conn.execute("SELECT count(*) FROM staged_jobs WHERE queue = %s",
                                       [queue]).fetchone()
                    if row is not None and row[0] == 0:
                        return True
                time.sleep(0.01)
        return False

    def _ended(self, rows: list[Row], *, committed: bool, called: float = 0.0,
               done: float = 0.0) -> None:
        for row in rows:
            if row.state != "planned":
                continue
            row.state = "committed" if committed else "rolled back"
            row.commit_called, row.ready_at = (called, done) if committed else (None, None)

    def _insert(self, conn: psycopg.Connection[Any], txn: Txn, rng: random.Random) -> None:
        # Open the transaction first: a psycopg transaction() block outside one would
        # commit on its own instead of being a savepoint. Sometimes the transaction
        # takes its id before its rows, as one that wrote elsewhere first would.
        conn.execute(rng.choice(["SELECT 1", "SELECT pg_current_xact_id()"]))
        jobs = [row for row in txn.rows if row.method == "many"]
        if jobs:
            drain.stage_many(conn, [drain.Job(
                TASK, [r.marker], {"m": r.marker}, queue=r.queue, task_id=r.task_id,
                priority=r.priority, countdown=3600 if r.delayed else None,
                expires=_expires(r, rng)) for r in jobs])
        for row in txn.rows:
            if row.method == "many":
                continue
            if row.savepoint_rollback or row.method in (*EXPLICIT_IDS, "reuse"):
                try:
                    with conn.transaction():
                        self._insert_one(conn, row, rng)
                        if row.savepoint_rollback:
                            raise psycopg.Rollback()
                except (psycopg.errors.UniqueViolation, psycopg.errors.DeadlockDetected):
                    pass  # an explicit id still staged (or being staged) by another row
                if row.savepoint_rollback or not self._present(conn, row):
                    row.state = "rolled back"
            else:
                self._insert_one(conn, row, rng)
        markers = [row.marker for row in txn.rows]
        for row_id, marker in conn.execute(
                "SELECT id, args->>0 FROM staged_jobs WHERE args->>0 = ANY(%s)", [markers]):
            next(r for r in txn.rows if r.marker == marker).id = int(row_id)

    def _present(self, conn: psycopg.Connection[Any], row: Row) -> bool:
        return conn.execute("SELECT FROM staged_jobs WHERE args->>0 = %s",
                            [row.marker]).fetchone() is not None

    def _insert_one(self, conn: psycopg.Connection[Any], row: Row, rng: random.Random) -> None:
        expires = _expires(row, rng)
        if row.method == "stage":
            drain.stage(conn, TASK, [row.marker], {"m": row.marker}, queue=row.queue,
                        task_id=row.task_id, priority=row.priority,
                        countdown=3600 if row.delayed else None, expires=expires)
            return
        params: list[Any] = [row.task_id, TASK, json.dumps([row.marker]),
                             json.dumps({"m": row.marker}), row.queue, row.priority,
                             3600 if row.delayed else None, expires]
        if row.method == "sql":
            conn.execute(_SQL_INSERT.format(id="", overriding="", value=""), params)
            return
        if row.method == "reuse":
            gone = [r.id for r in self.plan.rows if r.id is not None
                    and r.state == "committed" and r.marker in self.consumer.first]
            row_id = rng.choice(gone) if gone else EXPLICIT_IDS["huge"](rng.randrange(10**6))
            self.reused += bool(gone)
        else:
            row_id = EXPLICIT_IDS[row.method](int(row.marker.rsplit(".", 1)[1]))
        conn.execute(_SQL_INSERT.format(id="id, ", overriding="OVERRIDING SYSTEM VALUE ",
                                        value="%s, "), [row_id, *params])

    def _conflicting_updates(self, conn: psycopg.Connection[Any], txn: Txn) -> None:
        """Update rows the drain may hold in a batch, one short transaction each:
        args becomes [marker, n]. Each committed update is a new version that must
        be delivered (the drain removes a row only as it read it)."""
        for row in txn.rows:
            if row.state != "committed":
                continue
            for n, (pause, hold, rollback) in enumerate(row.updates, 1):
                time.sleep(pause)  # the workload's pace
                try:
                    cur = conn.execute("UPDATE staged_jobs SET args = %s WHERE id = %s "
                                       "AND args->>0 = %s",
                                       [json.dumps([row.marker, n]), row.id, row.marker])
                    time.sleep(hold)  # an update held open while the drain may delete it
                    if rollback:
                        conn.rollback()
                    else:
                        conn.commit()
                except psycopg.Error:
                    conn.rollback()
                    continue
                if cur.rowcount != 1:
                    break  # drained: nothing left to update
                if not rollback:
                    row.final_version = n
                    self.updated += 1

    def _update(self, conn: psycopg.Connection[Any], txn: Txn, rng: random.Random) -> None:
        """Make the transaction's delayed rows due, and move some rows to another priority."""
        delayed = [r for r in txn.rows if r.delayed and r.state == "committed"]
        moved = [r for r in txn.rows if r.reprioritize is not None and r.state == "committed"]
        if not (delayed or moved):
            return
        time.sleep(txn.update_after)  # the workload's pace
        for row in moved:  # one statement each: no lock order to deadlock on with the drain
            with contextlib.suppress(psycopg.Error):
                conn.execute("UPDATE staged_jobs SET priority = %s WHERE id = %s "
                              "AND args->>0 = %s", [row.reprioritize, row.id, row.marker])
                conn.commit()
            conn.rollback()
        for _attempt in range(5):
            updated = []
            try:
                for row in delayed:
                    due = "NULL" if row.delayed != "now" else "now()"
                    priority = rng.choice(PRIORITIES) if row.delayed == "null+priority" else (
                        row.priority)
                    cur = conn.execute(f"UPDATE staged_jobs SET not_before = {due}, "
                                       "priority = %s WHERE id = %s AND args->>0 = %s",
                                       [priority, row.id, row.marker])
                    if cur.rowcount == 1:
                        updated.append(row)
                time.sleep(txn.update_hold)  # an update held open
                called = time.monotonic()
                conn.commit()
            except psycopg.Error:
                conn.rollback()
                continue
            done = time.monotonic()
            for row in updated:
                row.due_called, row.ready_at = called, done
            self.problems += [f"delayed row {r.marker} (id {r.id}) left staged_jobs an hour "
                              "before it was due" for r in delayed if r not in updated]
            return
        self.problems.append(f"could not make delayed rows due: {[r.marker for r in delayed]}")
