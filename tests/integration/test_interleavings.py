"""Random interleavings against the real Postgres and RabbitMQ, with real in-process drains.

Each interleaving is a seeded plan (tests/interleaving_plan.py): writers
staging rows with ``drain.stage``, ``drain.stage_many`` and plain SQL, some
holding their transaction open, some rolling back (whole transactions or one
savepoint); explicit huge, negative, extreme and reused ids; an identity reset;
shared task ids; delayed rows made due by an UPDATE, rows moved to another
priority; conflicting updates (bursts of short transactions updating a staged
row every few milliseconds while the drain may hold it in a batch, some held
open, some rolled back: each committed update's version must be delivered);
expiring rows; a queue deleted on the broker after the drain declared
it and published to it, with rows to it staged right after (published while it
is gone: returned, kept staged), declared again later; 1, 2 or 4 lanes; drain
restarts and standby takeovers. The drains log in as the drain's
least-privileged role (tests/roles.py) and run with the periodic rescan off
(``rescan_interval=0``), so a row the low-water marks skip never arrives and
shows as a latency or settle failure.

The queue is deleted only while no message to it can be in flight: RabbitMQ
acks a message whose queue is deleted while the message is being routed to it
(rabbit_channel's "Deleted queue is a special case. Do not nack"), so neither
the drain nor any publisher can tell it was dropped. Deleting it mid-publish
loses such rows by the broker's own semantics, not the drain's; see
Writer.quiesce. Rows to that queue are required to arrive, with no latency bound.

After each interleaving the test waits (polling, with a deadline) until every
committed row was delivered or dead-lettered and staged_jobs is empty, then
checks: every committed row delivered or dead-lettered ('expired', expiring
rows only); nothing delivered before its commit, no rolled-back row ever
delivered; no row lost (gone from staged_jobs, not in dead_jobs, never
received); the last committed update of a row was delivered; every copy
carries its row's task id (headers['id'] and
correlation_id); every row of a healthy queue arrived within LATENCY_BOUND of
becoming due (its commit, or the commit of the UPDATE that made it due).

Environment:

* ``DRAIN_INTERLEAVING_SECONDS`` (default 60): run interleavings until this
  much time has passed (at least 3). ``make soak-interleavings`` sets it.
* ``DRAIN_INTERLEAVING_SEED``: replay one interleaving: run only this seed
  (the workload is replayed exactly; thread timing is not).

A one-line summary is printed and written, with every seed, to
test-artifacts/interleavings.json.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import random
import time
from typing import Any

import psycopg
import pytest

from tests import support
from tests.interleaving_plan import Plan, Row, make_plan
from tests.interleaving_support import (
    Consumer,
    Fleet,
    Writer,
    declare,
    delete_when_empty,
    reset_identity,
)

SECONDS = float(os.environ.get("DRAIN_INTERLEAVING_SECONDS", "60"))
REPLAY = os.environ.get("DRAIN_INTERLEAVING_SEED")
MIN_INTERLEAVINGS = 3
#: Seconds from a row becoming due to its first delivery: generous (the drain
#: needs milliseconds); with the rescan off, a row the marks skip never arrives.
LATENCY_BOUND = 15.0
#: Seconds to wait for every committed row to be delivered or dead-lettered.
SETTLE_TIMEOUT = 60.0
#: Seconds without a new delivery after which an empty staged_jobs counts as settled.
QUIET = 5.0
ARTIFACT = support.ROOT / "test-artifacts" / "interleavings.json"
WRITER_THREADS = 12


@dataclasses.dataclass
class Outcome:
    index: int
    seed: int
    plan: str
    seconds: float = 0.0
    rows: int = 0
    committed: int = 0
    rolled_back: int = 0
    delivered: int = 0
    dead: int = 0
    duplicates: int = 0
    reused_ids: int = 0
    collisions: int = 0
    drains_started: int = 0
    #: messages the broker returned (the deleted queue), rows published again after a
    #: confirm (drain_unsettled_rows_total)
    unroutable: int = 0
    unsettled: int = 0
    #: conflicting updates of staged rows committed, and rows the drains left
    #: staged because they changed under them (drain_conflicted_rows_total)
    updated: int = 0
    conflicted: int = 0
    queue_deleted: bool = False
    worst_latency: float = 0.0
    worst_row: str = ""
    failures: list[str] = dataclasses.field(default_factory=list)

    def line(self) -> str:
        return (f"interleaving {self.index} seed {self.seed}: {self.plan}; {self.committed} "
                f"committed, {self.rolled_back} rolled back, {self.delivered} delivered, "
                f"{self.dead} dead, {self.duplicates} duplicated, {self.reused_ids} ids reused, "
                f"{self.collisions} identity collisions, {self.drains_started} drains, queue "
                f"deleted: {self.queue_deleted}, {self.unroutable} returned, {self.unsettled} "
                f"unsettled, {self.updated} conflicting updates, {self.conflicted} rows left "
                f"staged on a conflict, worst latency {self.worst_latency:.3f}s, "
                f"{self.seconds:.1f}s"
                + (f", {len(self.failures)} FAILURE(S)" if self.failures else ""))


def _run_events(plan: Plan, fleet: Fleet, *, writer: Writer, outcome: Outcome) -> None:
    try:
        _events(plan, fleet, writer=writer, outcome=outcome)
    finally:
        writer.deleted.set()  # no writer waits for a deletion that will not come


def _events(plan: Plan, fleet: Fleet, *, writer: Writer, outcome: Outcome) -> None:
    deleted_at = 0.0
    for event in plan.events:
        time.sleep(max(0.0, writer.start + event.at - time.monotonic()))  # the workload's pace
        if event.action == "restart":
            fleet.restart(event.lane)
        elif event.action == "standby":
            fleet.start(event.lane)
        elif event.action == "takeover":
            fleet.takeover(event.lane)
        elif event.action == "reset_identity":
            reset_identity(writer.db_url)
        elif event.action == "delete" and plan.deleted is not None:
            # After the drain published to it (it declared it), once nothing is in flight.
            outcome.queue_deleted = writer.quiesce(plan.deleted) and delete_when_empty(
                plan.deleted)
            deleted_at = time.monotonic()
            writer.deleted.set()
        elif event.action == "redeclare" and plan.deleted is not None:
            time.sleep(max(0.0, deleted_at + event.after_delete - time.monotonic()))  # pace
            declare(plan.deleted)


def _dead(db_url: str, prefix: str) -> dict[str, list[str]]:
    """marker -> the reasons of its rows in dead_jobs."""
    found: dict[str, list[str]] = {}
    with psycopg.connect(db_url) as conn:
        for marker, reason in conn.execute(
                "SELECT args->>0, reason FROM dead_jobs WHERE args->>0 LIKE %s",
                [prefix + "%"]):
            found.setdefault(str(marker), []).append(str(reason))
    return found


def _staged(db_url: str) -> dict[str, str]:
    """marker -> a description of its row still in staged_jobs."""
    with psycopg.connect(db_url) as conn:
        return {str(r[0]): f"id={r[1]} priority={r[2]} not_before={r[3]} xact={r[4]}"
                for r in conn.execute("SELECT args->>0, id, priority, not_before, xact "
                                      "FROM staged_jobs")}


def _settle(db_url: str, prefix: str, committed: list[Row], consumer: Consumer) -> None:
    """Poll until staged_jobs is empty and every committed row arrived or is dead
    (or, staged_jobs empty, nothing more arrived for QUIET seconds: rows are missing
    that nothing can bring back any more)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    seen, quiet_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        if len(consumer.first) != seen:
            seen, quiet_since = len(consumer.first), time.monotonic()
        if not _staged(db_url):
            dead = _dead(db_url, prefix)
            if all(r.marker in consumer.first or r.marker in dead for r in committed):
                return
            if time.monotonic() - quiet_since > QUIET:
                return
        time.sleep(0.1)


def _row_failures(row: Row, *, plan: Plan, consumer: Consumer, dead: dict[str, list[str]],
                  staged: dict[str, str], outcome: Outcome) -> list[str]:
    """What is wrong with one row; tracks the worst latency in ``outcome``."""
    failures = []
    first = consumer.first.get(row.marker)
    what = (f"row {row.marker} (id {row.id}, {row.method}, priority {row.priority}, "
            f"delayed {row.delayed}, expiring {row.expiring}, reprioritized {row.reprioritize}, "
            f"{'deleted' if row.queue == plan.deleted else 'healthy'} queue)")
    wrong = {c for c in consumer.copies.get(row.marker, [])
             if c != (str(row.task_id), str(row.task_id))}
    if wrong:
        failures.append(f"{what}: a copy carries another task id (headers id, correlation_id):"
                        f" {sorted(wrong)} instead of {row.task_id}")
    if row.state != "committed":
        if first is not None:
            failures.append(f"{what}: rolled back, yet delivered")
        if row.marker in dead:
            failures.append(f"{what}: rolled back, yet in dead_jobs")
        return failures
    assert row.commit_called is not None and row.ready_at is not None
    if first is not None and first < row.commit_called:
        failures.append(f"{what}: delivered {row.commit_called - first:.3f}s before its "
                        "transaction committed")
    elif first is not None and row.delayed and (row.due_called is None
                                                or first < row.due_called):
        failures.append(f"{what}: delivered before the update that made it due committed")
    reasons = dead.get(row.marker, [])
    versions = consumer.versions.get(row.marker, [])
    if row.final_version is not None and not reasons and max(versions, default=0) != (
            row.final_version):
        failures.append(f"{what}: its last update (version {row.final_version}) was never "
                        f"delivered (versions delivered: {sorted(set(versions))})")
    if reasons and (row.expiring is None or set(reasons) != {"expired"}):
        failures.append(f"{what}: in dead_jobs with reason(s) {reasons}")
    if first is None and not reasons:
        failures.append(
            f"{what}: still staged ({staged[row.marker]}) after {SETTLE_TIMEOUT:g}s"
            if row.marker in staged else
            f"{what}: LOST: gone from staged_jobs, not in dead_jobs, never delivered")
    if first is not None and row.expiring is None and row.queue != plan.deleted:
        latency = first - row.ready_at
        if latency > outcome.worst_latency:
            outcome.worst_latency, outcome.worst_row = latency, what
        if latency > LATENCY_BOUND:
            failures.append(f"{what}: delivered {latency:.1f}s after it was due "
                            f"(bound {LATENCY_BOUND:g}s)")
    return failures


def _check(plan: Plan, consumer: Consumer, writer: Writer, outcome: Outcome) -> list[str]:
    """The invariants, on the state after the interleaving settled (or gave up)."""
    dead = _dead(writer.db_url, f"{outcome.index}.{outcome.seed}.")
    staged = _staged(writer.db_url)
    rows = {row.marker: row for row in plan.rows}
    failures = [f"the test's consumer failed: {consumer.error!r}"] if consumer.error else []
    failures += writer.problems
    failures += [f"malformed message: {m}" for m in consumer.malformed[:5]]
    failures += [f"published a job never staged: {m}" for m in consumer.first
                 if m not in rows][:5]
    for row in rows.values():
        failures += _row_failures(row, plan=plan, consumer=consumer, dead=dead, staged=staged,
                                  outcome=outcome)
    committed = [r for r in rows.values() if r.state == "committed"]
    outcome.rows = len(rows)
    outcome.committed = len(committed)
    outcome.rolled_back = len(rows) - len(committed)
    outcome.delivered = sum(1 for r in committed if r.marker in consumer.first)
    outcome.dead = sum(1 for r in committed if r.marker in dead)
    outcome.duplicates = sum(1 for copies in consumer.copies.values() if len(copies) > 1)
    return failures


def _diagnosis(fleet: Fleet) -> str:
    return "drains: " + "; ".join(
        f"lane {lane}: {r.drain.state.value}, marks {r.drain.marks.marks()}, "
        f"published {r.drain.published}" for lane, r in fleet.drains)


def run_interleaving(db_url: str, seed: int, index: int) -> Outcome:
    began = time.monotonic()
    plan = make_plan(seed, index)
    prefix = f"{index}.{seed}."
    outcome = Outcome(index, seed, plan.describe())
    queues = plan.queues + ([plan.deleted] if plan.deleted else [])
    consumer = Consumer(queues)
    fleet = Fleet(db_url, plan)
    try:
        for queue in queues:
            declare(queue)
        consumer.start()
        support.wait_for(lambda: consumer.live == set(queues) or consumer.error, 30,
                         "the consumer to subscribe")
        for lane in range(plan.lanes):
            fleet.start(lane)
        support.wait_for(fleet.all_lanes_active, 30, "a drain to lead every lane")
        start = time.monotonic()
        writer = Writer(db_url, plan, consumer, start)
        with concurrent.futures.ThreadPoolExecutor(WRITER_THREADS) as pool:
            futures = [pool.submit(writer.run, txn) for txn in plan.txns]
            _run_events(plan, fleet, writer=writer, outcome=outcome)
            for future in futures:
                future.result()
        committed = [r for r in plan.rows if r.state == "committed"]
        _settle(db_url, prefix, committed, consumer)
        diagnosis = _diagnosis(fleet)
        consumer.stop()
        failures = _check(plan, consumer, writer, outcome)
        if failures:
            outcome.failures = [*failures[:30], *(
                [f"... and {len(failures) - 30} more"] if len(failures) > 30 else []), diagnosis]
        outcome.reused_ids, outcome.collisions = writer.reused, writer.collisions
        outcome.drains_started = len(fleet.every)
        outcome.unroutable = fleet.total("drain_unroutable_total")
        outcome.unsettled = fleet.total("drain_unsettled_rows_total")
        outcome.updated = writer.updated
        outcome.conflicted = fleet.total("drain_conflicted_rows_total")
    finally:
        try:
            fleet.stop_all()
        finally:
            consumer.stop()
            for queue in queues:
                support.delete_queue(queue)
    outcome.seconds = time.monotonic() - began
    return outcome


def _summary(outcomes: list[Outcome], seconds: float) -> dict[str, Any]:
    worst = max(outcomes, key=lambda o: o.worst_latency, default=None)
    failed = [o for o in outcomes if o.failures]
    line = (f"interleavings: {len(outcomes)} tried in {seconds:.0f}s, "
            f"{sum(o.rows for o in outcomes)} rows ({sum(o.committed for o in outcomes)} "
            f"committed, {sum(o.rolled_back for o in outcomes)} rolled back, "
            f"{sum(o.dead for o in outcomes)} dead), "
            f"{sum(o.duplicates for o in outcomes)} duplicated, "
            f"{sum(o.updated for o in outcomes)} conflicting updates "
            f"({sum(o.conflicted for o in outcomes)} rows left staged on a conflict), "
            "worst latency "
            f"{worst.worst_latency if worst else 0.0:.3f}s (seed {worst.seed if worst else '-'})"
            f", failures: {', '.join(f'seed {o.seed}' for o in failed) or 'none'}")
    return {"summary": line, "seconds": seconds, "latency_bound": LATENCY_BOUND,
            "interleavings": [dataclasses.asdict(o) for o in outcomes]}


@pytest.mark.slow  # SECONDS of interleavings, a minute by default: not in make test-fast
@pytest.mark.timeout(int(SECONDS) + 600)
def test_random_interleavings_keep_the_invariants(db_url: str) -> None:
    outcomes: list[Outcome] = []
    started = time.monotonic()
    try:
        while True:
            elapsed = time.monotonic() - started
            if REPLAY is not None:
                if outcomes:
                    break
                seed = int(REPLAY)
            else:
                mean = elapsed / len(outcomes) if outcomes else 0.0
                if len(outcomes) >= MIN_INTERLEAVINGS and elapsed + mean > SECONDS:
                    break
                seed = random.SystemRandom().randrange(2**32)
            try:
                outcome = run_interleaving(db_url, seed, len(outcomes))
            except Exception as exc:
                raise AssertionError(f"interleaving {len(outcomes)}, seed {seed}: {exc!r}; "
                                     f"replay: DRAIN_INTERLEAVING_SEED={seed}") from exc
            outcomes.append(outcome)
            print(outcome.line(), flush=True)
            if outcome.failures:
                break
    finally:
        summary = _summary(outcomes, time.monotonic() - started)
        ARTIFACT.parent.mkdir(exist_ok=True)
        ARTIFACT.write_text(json.dumps(summary, indent=2) + "\n")
        print(summary["summary"], flush=True)
    for outcome in outcomes:
        if outcome.failures:
            pytest.fail(
                f"interleaving {outcome.index}, seed {outcome.seed} ({outcome.plan}): "
                + "\n  ".join(["invariants broken:", *outcome.failures])
                + f"\nreplay: DRAIN_INTERLEAVING_SEED={outcome.seed} .venv/bin/python -m "
                "pytest -s tests/integration/test_interleavings.py", pytrace=False)
