"""bench_curves' points: each one a fresh database, a pile staged by SQL, and one figure.

Every point stages ``good`` jobs for a queue that works (``bench.flowing``) after
its pile, runs an in-process drain and times how long those take to reach their
queue: the rate the rest of the work keeps while a pile sits in the table. The
piles are staged by one ``INSERT ... SELECT`` (millions of rows in seconds), then
``VACUUM ANALYZE``, as a table that has been there a while would be.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import curves_app
import harness
import psycopg
from bench_throughput import raw_pika, staged_messages
from harness import BROKER_URL, broker_channel, staged_count
from pika.adapters.select_connection import SelectConnection

from drain.broker.queue_declare import DECLARE_CHANNELS
from drain.daemon.runner import Drain
from drain.postgres import dead as dead_jobs
from drain.postgres import pauses
from drain.postgres import status as drain_status
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters

PILE, GOOD = "bench.pile", "bench.flowing"
#: The messages in flight the queues curve tries, as the drain's batch size x pipeline
#: and as raw pika's confirm window (batch x pipeline): the best of each is compared.
#: The first is the drain's default; over thousands of queues each queue's writes
#: are flushed apart, and more in flight means fewer flushes per message.
DEPTHS = ((1000, 4), (1000, 8))
#: Seconds a point may take (the drain publishing the good jobs), else it is recorded
#: as not done.
TIMEOUT = 300.0


def sql_stage(url: str, n: int, queue: str | None, task: str, *, queues: int = 1,
              tasks: int = 1, tags: int = 0) -> None:
    """``n`` rows in one statement: for ``queue`` (None: no queue given), spread over
    ``queues`` queues ``<queue>_<i>`` when more than one, ``tasks`` task names
    ``<task>.<i>`` and ``tags`` tags when more than one (0: no tag)."""
    if n <= 0:
        return
    with psycopg.connect(url) as conn:
        conn.execute(
            "INSERT INTO staged_jobs (task_name, args, queue, tag) "
            "SELECT CASE WHEN %(tasks)s > 1 THEN %(task)s || '.' || (i %% %(tasks)s) "
            "            ELSE %(task)s END, "
            "       jsonb_build_array(i), "
            "       CASE WHEN %(queues)s > 1 THEN %(queue)s || '_' || (i %% %(queues)s) "
            "            ELSE %(queue)s END, "
            "       CASE WHEN %(tags)s > 0 THEN 't' || (i %% %(tags)s) END "
            "FROM generate_series(1, %(n)s) AS i",
            {"n": n, "queue": queue, "task": task, "queues": queues, "tasks": tasks,
             "tags": tags})
    vacuum(url)


def vacuum(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE staged_jobs")
        conn.execute("VACUUM ANALYZE dead_jobs")


def refuse(queue: str) -> None:
    """Declare ``queue`` with an argument the drain does not give: its declare gets 406."""
    with broker_channel() as channel:
        channel.queue_declare(queue, durable=True, arguments={"x-max-length": 1})


def delete_queues(names: list[str]) -> None:
    with contextlib.suppress(Exception), broker_channel() as channel:
        for name in names:
            channel.queue_delete(name)


def timed_drain(url: str, done: Callable[[], bool] | int, *, app: str = "",
                what: str = "the good jobs published", depth: tuple[int, int] = (1000, 4),
                ) -> float:
    """Run a drain until ``done``; the seconds it took. ``done`` as a number: until
    the drain itself counts that many rows confirmed (harness.seconds_to_confirm)."""
    batch_size, pipeline = depth
    settings = Settings(database_url=url, broker_url=BROKER_URL, celery_app=app,
                        batch_size=batch_size, pipeline=pipeline)
    if not callable(done):
        return harness.seconds_to_confirm(settings, done, TIMEOUT, f"bench_curves: {what}")
    started = time.perf_counter()
    with harness.running(Drain(settings)) as thread:
        def check() -> bool:
            if done():
                return True
            if not thread.is_alive():
                raise SystemExit(f"bench_curves: the drain stopped ({what})")
            return False

        harness.wait_until(check, TIMEOUT, f"bench_curves: {what}", interval=0.02)
        return time.perf_counter() - started


def reached(queue: str, n: int) -> Callable[[], bool]:
    counter = harness.QueueCounter(queue)
    return lambda: counter.count() >= n


def good_rate(url: str, good_queue: str, good: int, *, app: str = "") -> float:
    return good / timed_drain(url, reached(good_queue, good), app=app)


# -- the curves ---------------------------------------------------------------------------

def backlog(size: int, good: int) -> dict[str, Any]:
    """The rate over the first ``good`` jobs of a backlog of ``size``."""
    with harness.Setup("curve_backlog") as setup:
        url = setup.database()
        queue = setup.queue("q")
        sql_stage(url, size, queue, GOOD)
        return {"x": size, "rate": good_rate(url, queue, min(good, size))}


def queues(count: int, good: int) -> dict[str, Any]:
    """``good`` jobs over ``count`` queues: the drain, and raw pika declaring the same
    queues and publishing the same messages, each at the same depths in flight
    (DEPTHS: the drain's batch size x pipeline, raw pika's confirm window), in turns;
    the best of each is compared. The broker's confirms over thousands of queues vary
    by 2 x from one try to the next, and depend on the depth.

    Raw pika declares at its best: over as many channels at once as the drain
    (DECLARE_CHANNELS), each channel's share sent with ``nowait`` and one
    ``basic.qos`` as its barrier (:func:`declare_pipelined`). Both start with no
    queue declared."""
    with harness.Setup("curve_queues") as setup:
        url = setup.database()
        prefix = f"bench_curve_queues_{setup.tag}"
        names = [prefix] if count == 1 else [f"{prefix}_{i}" for i in range(count)]
        setup.callback(delete_queues, names)
        drain, raw = [], []
        sql_stage(url, good, prefix, GOOD, queues=count)
        messages = staged_messages(url)  # raw pika publishes these, each round
        staged = True  # the good jobs are in the table, waiting for the drain's turn
        for round_, depth in enumerate(DEPTHS):
            for who in harness.turns(round_, ("drain", "raw")):
                if who == "drain":
                    if not staged:
                        sql_stage(url, good, prefix, GOOD, queues=count)
                    drain.append(timed_drain(url, good, depth=depth))
                    assert staged_count(url) == 0, "bench_curves: the drain left rows staged"
                    staged = False
                else:
                    raw.append(declare_pipelined(names)
                               + raw_pika(messages, pre_encoded=True,
                                          window=depth[0] * depth[1]))
                delete_queues(names)
        return {"x": count, "rate": good / min(drain), "raw_rate": good / min(raw),
                "broker_nofile": broker_nofile(count)}


def broker_nofile(queues: int) -> int | None:
    """The local RabbitMQ's file descriptor limit (None: no local broker to read).
    Near the number of queues or below, its queues wait on each other for file
    handles and the point measures that (docs/running.md): said on stderr when
    below twice the queues."""
    found = subprocess.run(["pgrep", "-o", "-f", "beam.*rabbit"], capture_output=True,
                           text=True, check=False).stdout.split()
    if not found:
        return None
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{found[0]}/limits") as limits:
        for line in limits:
            if line.startswith("Max open files"):
                limit = int(line.split()[3])
                if limit < 2 * queues:
                    print(f"bench_curves: the broker may open only {limit} files, for {queues:,}"
                          " queues: this point measures its file handle cache",
                          file=sys.stderr)
                return limit
    return None


def declare_pipelined(names: list[str], channels: int = DECLARE_CHANNELS) -> float:
    """Declare the durable queues over ``channels`` channels at once, each channel's
    share sent with ``nowait`` and one ``basic.qos`` as its barrier; the seconds from
    the channels being open until every barrier was answered."""
    state = {"t0": 0.0, "t1": 0.0, "left": channels}
    opened: list[Any] = []

    def on_barrier(_frame: Any) -> None:
        state["left"] -= 1
        if not state["left"]:
            state["t1"] = time.perf_counter()
            conn.close()

    def on_channel(channel: Any) -> None:
        opened.append(channel)
        if len(opened) < channels:
            return
        state["t0"] = time.perf_counter()
        for i, each in enumerate(opened):
            for name in names[i::channels]:
                each.queue_declare(name, durable=True)  # no callback: nowait
            each.basic_qos(prefetch_count=0, callback=on_barrier)

    def on_open(c: Any) -> None:
        for _ in range(channels):
            c.channel(on_open_callback=on_channel)

    conn = SelectConnection(
        broker_parameters(BROKER_URL), on_open_callback=on_open,
        on_close_callback=lambda c, e: c.ioloop.stop())
    conn.ioloop.start()
    assert state["t1"], "raw pika: the declares were not all answered"
    return state["t1"] - state["t0"]


def held(pile: int, good: int, *, app: str = "") -> dict[str, Any]:
    """``pile`` rows for a queue the broker refuses, staged before ``good`` jobs;
    with ``app`` (bench/curves_app.py's ``app``, plain routes, ``function``, a
    router function, or ``arguments``, one that reads the arguments), both staged
    without a queue and routed by it."""
    with harness.Setup("curve_held") as setup:
        url = setup.database()
        refused = setup.queue("refused", declare=False, routed=bool(app))
        refuse(refused)
        good_queue = setup.queue("good", routed=bool(app))
        os.environ["CURVES_PILE_QUEUE"], os.environ["CURVES_GOOD_QUEUE"] = refused, good_queue
        curves_app.route_static(refused, good_queue)
        sql_stage(url, pile, None if app else refused, PILE)
        sql_stage(url, good, None if app else good_queue, GOOD)
        rate = good_rate(url, good_queue, good, app=f"curves_app:{app}" if app else "")
        return {"x": pile, "rate": rate}


def paused(pile: int, good: int, *, kind: str = "queue", app: str = "") -> dict[str, Any]:
    """``pile`` rows of a queue, or a task (``kind``), whose publishing an operator
    paused (`drain pause`, drain.postgres.pauses), staged before ``good`` jobs of
    another queue and task; 0: no pause, no pile. With ``app`` ("app", plain
    routes), both are staged without a queue and routed by it. Timed by the
    drain's own count: the paused rows are never confirmed."""
    with harness.Setup("curve_paused") as setup:
        url = setup.database()
        held_queue = setup.queue("paused", routed=bool(app))
        good_queue = setup.queue("good", routed=bool(app))
        curves_app.route_static(held_queue, good_queue)
        if pile:
            with psycopg.connect(url, autocommit=True) as conn:
                pauses.pause(conn, kind, held_queue if kind == "queue" else PILE,
                             reason="bench_curves", actor="bench")
        sql_stage(url, pile, None if app else held_queue, PILE)
        sql_stage(url, good, None if app else good_queue, GOOD)
        seconds = timed_drain(url, good, app=f"curves_app:{app}" if app else "",
                              what="the jobs of the queue not paused")
        if pile:
            assert staged_count(url) == pile, "a paused job was published"
        return {"x": pile, "rate": good / seconds}


def refused(count: int, good: int, per_queue: int = 5) -> dict[str, Any]:
    """``count`` refused queues with ``per_queue`` rows each, then ``good`` jobs."""
    with harness.Setup("curve_refused") as setup:
        url = setup.database()
        prefix = f"bench_curve_refused_{setup.tag}"
        names = [f"{prefix}_{i}" for i in range(count)]
        setup.callback(delete_queues, names)
        with broker_channel() as channel:
            for name in names:
                channel.queue_declare(name, durable=True, arguments={"x-max-length": 1})
        sql_stage(url, count * per_queue, prefix, PILE, queues=count)
        if count == 1:  # one queue is staged as <prefix>, not <prefix>_0
            with psycopg.connect(url) as conn:
                conn.execute("UPDATE staged_jobs SET queue = %s", (names[0],))
        good_queue = setup.queue("good")
        sql_stage(url, good, good_queue, GOOD)
        return {"x": count, "rate": good_rate(url, good_queue, good)}


def locked(count: int, good: int) -> dict[str, Any]:
    """``count`` rows locked (SELECT ... FOR UPDATE, held open) while ``good`` jobs
    drain; then the lock is released and the locked jobs' deliveries counted."""
    with harness.Setup("curve_locked") as setup:
        url = setup.database()
        locked_queue = setup.queue("locked")
        good_queue = setup.queue("good")
        sql_stage(url, count, locked_queue, PILE)
        sql_stage(url, good, good_queue, GOOD)
        holder = psycopg.connect(url)
        setup.callback(holder.close)
        holder.execute("SELECT id FROM staged_jobs WHERE queue = %s FOR UPDATE",
                       (locked_queue,)).fetchall()
        locked_counter = harness.QueueCounter(locked_queue)
        setup.callback(locked_counter.close)
        runner = Drain(Settings(database_url=url, broker_url=BROKER_URL))
        started = time.perf_counter()
        with harness.running(runner):
            harness.wait_until(reached(good_queue, good), TIMEOUT,
                               "bench_curves: the good jobs published beside locked rows",
                               interval=0.02)
            rate = good / (time.perf_counter() - started)
            while_locked = locked_counter.count()
            holder.rollback()
            harness.wait_until(lambda: staged_count(url) == 0, TIMEOUT,
                               "bench_curves: the locked rows published once released")
        deliveries = locked_counter.count()
        return {"x": count, "rate": rate, "deliveries": deliveries,
                "duplicates": deliveries - count, "delivered_while_locked": while_locked}


def dead(count: int, port: int) -> dict[str, Any]:
    """``count`` rows in dead_jobs: the status read (what ``drain status`` and the
    metrics' sampler run), the ``drain status`` command, and a drain's status page,
    /status.json and /metrics scrape."""
    with harness.Setup("curve_dead") as setup:
        url = setup.database()
        if count:
            with psycopg.connect(url) as conn:
                conn.execute(
                    "INSERT INTO dead_jobs (id, task_id, task_name, args, kwargs, queue, "
                    "priority, staged_at, reason, detail) "
                    "SELECT i, gen_random_uuid(), 'bench.dead.' || (i %% 100), '[]', '{}', "
                    "'q' || (i %% 10), 0, now(), "
                    "(ARRAY['expired','invalid','refused','purged'])[1 + i %% 4], NULL "
                    "FROM generate_series(1, %s) AS i", (count,))
        vacuum(url)
        with psycopg.connect(url, autocommit=True) as conn:
            started = time.perf_counter()
            drain_status.read(conn, Settings().lock_key)
            read_seconds = time.perf_counter() - started
            # `drain dead list` (and the console's view), by each filter: the slowest.
            listing = {name: _listing_seconds(conn, filters)
                       for name, filters in DEAD_FILTERS.items()}
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "drain", "status", "--json", "--database-url",
                        url], check=True, stdout=subprocess.DEVNULL, cwd=harness.ROOT)
        cli_seconds = time.perf_counter() - started
        env = {**os.environ, "DRAIN_METRICS_PORT": str(port), "DRAIN_DATABASE_URL": url,
               "DRAIN_BROKER_URL": BROKER_URL}
        setup.process(harness.drain_process("run", env=env))
        base = f"http://127.0.0.1:{port}"
        harness.wait_until(lambda: _sampled(base), 120, "bench_curves: the drain's first sample")
        timings = {path: _get_seconds(base + path) for path in ("/", "/status.json", "/metrics")}
        slowest = max(listing, key=lambda name: listing[name])
        return {"x": count, "status_read": read_seconds, "status_cli": cli_seconds,
                "page": timings["/"], "status_json": timings["/status.json"],
                "scrape": timings["/metrics"], "dead_list": listing[slowest],
                "dead_list_slowest": slowest}


#: The filters of ``drain dead list`` the dead curve times.
DEAD_FILTERS = {
    "none": dead_jobs.Filters(), "reason": dead_jobs.Filters(reason="invalid"),
    "task": dead_jobs.Filters(task="bench.dead.7"), "queue": dead_jobs.Filters(queue="q3"),
    "older_than": dead_jobs.Filters(older_than=dt.timedelta(hours=1)),
    "task_id": dead_jobs.Filters(task_id=uuid.UUID(int=7)),
}


def _listing_seconds(conn: psycopg.Connection[Any], filters: dead_jobs.Filters) -> float:
    """The best of three ``drain dead list`` reads (count and 50 rows)."""
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dead_jobs.listing(conn, filters, 50)
        best = min(best, time.perf_counter() - started)
    return best


def _sampled(base: str) -> bool:
    with (contextlib.suppress(OSError, ValueError),
          urllib.request.urlopen(base + "/status.json", timeout=5) as answer):
        return bool(json.load(answer).get("status"))
    return False


def _get_seconds(url: str, tries: int = 5) -> float:
    """The best of ``tries`` GETs, in seconds."""
    best = float("inf")
    for _ in range(tries):
        started = time.perf_counter()
        with urllib.request.urlopen(url, timeout=60) as answer:
            answer.read()
        best = min(best, time.perf_counter() - started)
    return best


def series(count: int, rows: int, port: int) -> dict[str, Any]:
    """``rows`` jobs over ``count`` task names and ``count`` tags, half of them held
    (a refused queue: they stay staged, in the backlog's groups), half published:
    how many series a /metrics scrape has."""
    with harness.Setup("curve_series") as setup:
        url = setup.database()
        held_queue = setup.queue("refused", declare=False)
        refuse(held_queue)
        good_queue = setup.queue("good")
        sql_stage(url, rows // 2, held_queue, PILE, tasks=count, tags=count)
        sql_stage(url, rows - rows // 2, good_queue, GOOD, tasks=count, tags=count)
        env = {**os.environ, "DRAIN_METRICS_PORT": str(port), "DRAIN_DATABASE_URL": url,
               "DRAIN_BROKER_URL": BROKER_URL, "DRAIN_METRICS_INTERVAL": "0.5"}
        setup.process(harness.drain_process("run", env=env))
        harness.wait_until(reached(good_queue, rows - rows // 2), TIMEOUT,
                           "bench_curves: the published half")
        base = f"http://127.0.0.1:{port}"
        harness.wait_until(lambda: _sampled(base), 120, "bench_curves: a sample")
        with urllib.request.urlopen(base + "/metrics", timeout=60) as answer:
            text = answer.read().decode()
        lines = [line for line in text.splitlines() if line and not line.startswith("#")]
        return {"x": count, "series": len(lines), "bytes": len(text)}
