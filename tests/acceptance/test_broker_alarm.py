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

import os
import re
import statistics
import textwrap
import threading
import time
from pathlib import Path
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


#: The drain's own heartbeat in the next test (DRAIN_BROKER_HEARTBEAT): a silent
#: broker is noticed within 2 x (HEARTBEAT + 5) s (pika checks every heartbeat + 5 s).
HEARTBEAT = 2


def test_a_blocked_broker_that_dies_silently_is_noticed_though_the_app_sets_no_heartbeat(
    db_url: str, queue: str, spawn: Any, broker_alarm: None, tmp_path: Path
) -> None:
    """The app's ``broker_heartbeat = 0`` asks for none: the drain uses its own
    anyway (issue 24, item 6). The broker blocks the drain (a memory alarm), then
    the first broker of the list goes silent (a stalled path: no close, nothing
    forwarded) while the second is down: the drain notices within the heartbeat's
    bound, ``drain_broker_blocked`` returns to 0 with the connection, and once the
    alarm clears and the second broker is back every held job goes out through it."""
    first = support.TcpProxy(support.BROKER_PORT).start()
    second = support.TcpProxy(support.BROKER_PORT).start()
    shown = [support.broker_url(p.port, password="***") for p in (first, second)]
    (tmp_path / "silent_broker_app.py").write_text(textwrap.dedent(f"""
        from celery import Celery

        app = Celery("silent_broker_app", set_as_current=False)
        app.conf.broker_url = ("{support.broker_url(first.port)};"
                               "{support.broker_url(second.port)}")
        app.conf.broker_heartbeat = 0


        @app.task(name="silent_broker.record")
        def record(i, **kwargs):
            return i
    """))
    env = support.drain_env(db_url, DRAIN_BROKER_HEARTBEAT=str(HEARTBEAT))
    del env["DRAIN_BROKER_URL"]
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    port = support.free_port()
    try:
        proc = spawn(support.drain_argv(
            "run", "--app", "silent_broker_app", "--poll-interval", "0.2",
            "--confirm-timeout", str(CONFIRM_TIMEOUT), "--metrics-port", str(port)), env, "drain")
        proc.wait_for_output(f"connected to broker at {shown[0]} (1 of 2)", timeout=30)
        before = _stage_app(db_url, queue, range(5))
        support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first jobs")
        try:
            alarm.raise_alarm()
            held = _stage_app(db_url, queue, range(5, 25))  # the drain tries to publish them
            proc.wait_for_output("blocks publishing", timeout=30)
            support.wait_for(lambda: _blocked_metric(port) == 1, 30,
                             "drain_broker_blocked to be 1")
            second.refuse()  # down: the drain cannot fail over at once
            first.stall()  # silent: the connection stays open, nothing comes back
            silent_at = time.monotonic()
            support.wait_for(lambda: "blocked publishing for" in proc.output(), NOTICED_WITHIN,
                             "the drain to notice the silent broker")
            noticed = time.monotonic() - silent_at
            first.refuse()
            support.wait_for(lambda: _blocked_metric(port) == 0, 30,
                             "drain_broker_blocked to return to 0 with the connection")
            assert support.staged_count(db_url) == len(held)
        finally:
            alarm.clear_alarm()
        second.restart()
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                         "the held jobs to go out through the second broker")
    finally:
        first.stop()
        second.stop()
    out = proc.output()
    assert f"{shown[1]} (2 of 2)" in out, out[-3000:]
    assert _blocked_metric(port) == 0
    copies = support.check_at_least_once(support.drain_queue(queue), {**before, **held})
    print(f"\n[blocked, then silent] app broker_heartbeat 0, drain heartbeat {HEARTBEAT}s: "
          f"noticed {noticed:.1f}s after the broker went silent (bound "
          f"{2 * (HEARTBEAT + 5)}s); {sum(copies.values()) - len(copies)} duplicates")


#: How long the test waits for the silent broker to be noticed: far above the
#: bound (2 x (HEARTBEAT + 5) s); without a heartbeat it is never noticed.
NOTICED_WITHIN = 60.0


def _stage_app(db_url: str, queue: str, numbers: range) -> dict[str, int]:
    """Stage the app's task for each number: {task id: number}."""
    with support.connect(db_url) as conn:
        ids = drain.stage_many(conn, (drain.Job("silent_broker.record", [i], {"i": i},
                                                queue=queue) for i in numbers))
    return {str(task_id): i for i, task_id in zip(numbers, ids, strict=True)}
