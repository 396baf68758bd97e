"""A real RabbitMQ resource alarm: the broker blocks the drain's publishing.

Each test raises the broker's memory alarm with ``rabbitmqctl`` (tests/broker_alarm.py)
and clears it in a ``finally``; the ``broker_alarm`` fixture clears it again after
the test, so a failing test never leaves the broker blocked for the next one.
The drain must say so once, show it in ``drain_broker_blocked``, keep its
connection (no reconnect storm), abandon nothing however long the alarm lasts,
lose nothing, and publish again as soon as the alarm clears, while the
application goes on staging.
"""

from __future__ import annotations

import re
import statistics
import threading
import time
from typing import Any

import drain
from tests import broker_alarm as alarm
from tests import support

#: Never set: waiting on it lets a fault last, it synchronises nothing.
_FAULT_CLOCK = threading.Event()

#: The drain's confirm timeout in these tests: the alarms outlast it.
CONFIRM_TIMEOUT = 2.0


def _blocked_metric(port: int) -> float | None:
    status, text = support.http_get(port, "/metrics")
    assert status == 200
    match = re.search(r"^drain_broker_blocked (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


def _start(spawn: Any, db_url: str, port: int) -> support.Process:
    proc: support.Process = spawn(
        support.drain_argv("run", "--poll-interval", "0.2", "--batch-size", "500",
                           "--confirm-timeout", str(CONFIRM_TIMEOUT),
                           "--metrics-port", str(port)),
        support.drain_env(db_url), "drain")
    proc.wait_for_output("broker connected", timeout=30)
    return proc


def _stage_timed(db_url: str, queue: str, n: int) -> tuple[dict[str, int], list[float]]:
    """Stage ``n`` jobs, one transaction each: {task id: i} (as support.stage_backlog)
    and each commit's time in ms."""
    ids: dict[str, int] = {}
    took: list[float] = []
    with support.connect(db_url, autocommit=True) as conn:
        for i in range(n):
            started = time.perf_counter()
            with conn.transaction():
                task_id = drain.stage(conn, "celery_app.record", [i], {"i": i}, queue=queue)
            took.append((time.perf_counter() - started) * 1000)
            ids[str(task_id)] = i
    return ids, took


def _hold(db_url: str, port: int, proc: support.Process) -> int:
    """While blocked: wait until the drain sits in its blocked wait (every cycle
    committed), then let the alarm outlast the confirm timeout; nothing may be
    published or deleted meanwhile. Returns the staged rows."""
    support.wait_for(lambda: _blocked_metric(port) == 1, 30, "drain_broker_blocked to be 1")
    held = support.staged_count(db_url)
    _FAULT_CLOCK.wait(CONFIRM_TIMEOUT * 2 + 1)  # the alarm lasts: a fault, not a sync
    assert support.staged_count(db_url) == held, "rows deleted while the broker was blocked"
    assert support.http_get(port, "/healthz")[0] == 200, "a blocked broker is not a dead drain"
    status, body = support.http_get(port, "/status.json")
    assert status == 200 and '"broker blocked"' in body
    return held


def _check_calm(out: str) -> None:
    """One connection throughout, one line each way, no batch given up."""
    assert out.count("broker connected") == 1, "the drain reconnected during the alarm"
    assert out.count("blocks publishing") == 1
    assert out.count("unblocked after") == 1
    assert "within" not in out and "lost" not in out, "a batch was abandoned"


def test_an_alarm_under_a_backlog_holds_then_resumes(
    db_url: str, queue: str, spawn: Any, broker_alarm: None
) -> None:
    staged = support.stage_backlog(db_url, queue, 30_000)
    port = support.free_port()
    proc = _start(spawn, db_url, port)
    support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                     "the drain to make progress")
    before_ids, before = _stage_timed(db_url, queue, 100)
    mark = len(proc.output())
    try:
        alarm.raise_alarm()
        proc.wait_for_output("blocks publishing", timeout=30, after=mark)
        during_ids, during = _stage_timed(db_url, queue, 100)  # the application goes on
        held = _hold(db_url, port, proc)
        assert held > 0, "the backlog drained before the alarm; stage more"
    finally:
        alarm.clear_alarm()
    cleared = time.monotonic()
    support.wait_for(lambda: support.staged_count(db_url) < held, 30,
                     "the drain to publish again after the alarm")
    resumed = time.monotonic() - cleared
    support.wait_for(lambda: support.staged_count(db_url) == 0, 120, "the backlog to drain")
    expected = {**staged, **before_ids, **during_ids}
    copies = support.check_at_least_once(support.drain_queue(queue), expected)
    duplicates = sum(copies.values()) - len(copies)
    out = proc.output()
    print(f"\n[broker alarm, backlog] held {held} rows for {CONFIRM_TIMEOUT * 2 + 1:g}s; "
          f"published again {resumed:.3f}s after the alarm cleared; {duplicates} duplicates; "
          f"staging p50 {statistics.median(before):.2f} ms before, "
          f"{statistics.median(during):.2f} ms during the alarm")
    _check_calm(out)
    assert duplicates == 0, "nothing was abandoned, so nothing may be published twice"
    assert _blocked_metric(port) == 0


def test_an_alarm_while_idle_holds_new_jobs_then_delivers_them(
    db_url: str, queue: str, spawn: Any, broker_alarm: None
) -> None:
    port = support.free_port()
    proc = _start(spawn, db_url, port)
    first, _ = _stage_timed(db_url, queue, 5)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first jobs")
    try:
        alarm.raise_alarm()
        ids, _ = _stage_timed(db_url, queue, 20)  # the drain tries to publish them
        proc.wait_for_output("blocks publishing", timeout=30)
        held = _hold(db_url, port, proc)
        assert held == len(ids)
    finally:
        alarm.clear_alarm()
    cleared = time.monotonic()
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30,
                     "the held jobs to be published after the alarm")
    print(f"\n[broker alarm, idle] {len(ids)} jobs published "
          f"{time.monotonic() - cleared:.3f}s after the alarm cleared")
    copies = support.check_at_least_once(support.drain_queue(queue), {**first, **ids})
    assert sum(copies.values()) == len(copies)
    _check_calm(proc.output())
