"""Throughput: the drain against the raw publish ceiling and Celery, in one run.

    python bench/bench_throughput.py [--jobs N] [--celery-jobs N]

Measures, against the same local Postgres and RabbitMQ, one after the other,
each into its own fresh durable queue (deleted afterwards):

1. raw pika, pipelined publisher confirms with a sliding window of 1,000
   outstanding messages, publishing exactly the messages the drain would
   publish (built beforehand, not timed): the ceiling;
2. Celery ``send_task`` with ``broker_transport_options={'confirm_publish': True}``,
   what applications do today;
3. the drain: N rows staged with COPY (not timed), then ``Drain.run`` until the
   table is empty (staged -> published -> confirmed -> deleted).

Prints a table with rates and ratios. Never run by the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import uuid
from typing import Any

import pika
import psycopg
from pika.adapters.select_connection import SelectConnection

import drain
from drain import message, store
from drain.amqp import EncodedProperties
from drain.config import Settings, broker_parameters
from drain.runner import Drain

ADMIN_URL = os.environ.get("DRAIN_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
WINDOW = 1000


def fresh_database(name: str) -> str:
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url) as conn:
        store.migrate(conn)
    return url


def drop_database(name: str) -> None:
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def delete_queue(queue: str) -> None:
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        conn.channel().queue_delete(queue)
    finally:
        conn.close()


def declare_queue(queue: str) -> None:
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        conn.channel().queue_declare(queue, durable=True)
    finally:
        conn.close()


def stage(url: str, n: int, queue: str) -> None:
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"}, queue=queue)
                for i in range(n)
            ),
        )


def raw_pika(messages: list[message.Message], *, pre_encoded: bool = False) -> float:
    """Publish with a sliding window of WINDOW unconfirmed messages; returns seconds.

    ``pre_encoded`` hands pika the drain's precomputed property bytes instead of
    letting pika encode ``BasicProperties`` itself: the same wire bytes with less
    client CPU, which on a small machine leaves more CPU to the broker.
    """
    state: dict[str, Any] = {"next": 0, "acked": 0, "outstanding": 0, "t0": 0.0, "t1": 0.0}
    n = len(messages)

    def publish_more(channel: Any) -> None:
        while state["outstanding"] < WINDOW and state["next"] < n:
            m = messages[state["next"]]
            properties = (
                EncodedProperties(m.encoded_properties) if pre_encoded
                else pika.BasicProperties(headers=m.headers, **m.properties)
            )
            channel.basic_publish("", m.routing_key, m.body, properties, mandatory=True)
            state["next"] += 1
            state["outstanding"] += 1

    def on_confirm(frame: Any) -> None:
        tag = frame.method.delivery_tag
        done = tag - state["acked"] if frame.method.multiple else 1
        state["acked"] += done
        state["outstanding"] -= done
        if state["acked"] >= n:
            state["t1"] = time.perf_counter()
            conn.close()
            return
        publish_more(channel_box[0])

    channel_box: list[Any] = []

    def on_selectok(_frame: Any) -> None:
        state["t0"] = time.perf_counter()
        publish_more(channel_box[0])

    def on_channel(channel: Any) -> None:
        channel_box.append(channel)
        channel.confirm_delivery(on_confirm, callback=on_selectok)

    conn = SelectConnection(
        broker_parameters(BROKER_URL),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_close_callback=lambda c, e: c.ioloop.stop(),
    )
    conn.ioloop.start()
    assert state["acked"] == n, state
    return float(state["t1"] - state["t0"])


def celery_send_task(n: int, queue: str) -> float:
    from celery import Celery

    app = Celery("bench", broker=BROKER_URL)
    app.conf.broker_transport_options = {"confirm_publish": True}
    app.send_task("bench.index_annotation", args=[0], queue=queue)  # connect, declare
    t0 = time.perf_counter()
    for i in range(n):
        app.send_task("bench.index_annotation", args=[i], kwargs={"user": f"user{i % 97}"},
                      queue=queue)
    elapsed = time.perf_counter() - t0
    app.close()
    return elapsed


def run_drain(url: str, batch_size: int) -> tuple[float, int]:
    d = Drain(Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch_size),
              exit_when_empty=True)
    t0 = time.perf_counter()
    d.run()
    return time.perf_counter() - t0, d.published


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("BENCH_JOBS", "100000")))
    parser.add_argument("--celery-jobs", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3,
                        help="raw and drain alternate this many times; medians are reported")
    args = parser.parse_args()
    n = args.jobs
    tag = uuid.uuid4().hex[:8]
    db = f"drain_bench_{tag}"
    url = fresh_database(db)
    queues = {k: f"bench_{k}_{tag}" for k in ("raw", "celery", "drain")}
    results: dict[str, tuple[int, float]] = {}
    raw_name = "raw pika, pipelined confirms (window 1000)"
    drain_name = f"drain run (batch {args.batch_size}), staged -> deleted"
    raw_times: list[float] = []
    encoded_name = "raw pika, pre-encoded properties (as the drain)"
    encoded_times: list[float] = []
    drain_times: list[float] = []
    try:
        # The exact messages the drain would publish, built from staged rows.
        stage(url, n, queues["raw"])
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                "SELECT id, task_id, task_name, args::text, kwargs::text, queue "
                "FROM staged_jobs ORDER BY id"
            ).fetchall()
            conn.execute("DELETE FROM staged_jobs")
        origin = message.origin()
        messages = [
            message.build(message.StagedRow(*r), origin=origin, reply_to=str(uuid.uuid4()))
            for r in rows
        ]
        for round_ in range(args.rounds):
            declare_queue(queues["raw"])
            raw_times.append(raw_pika(messages))
            delete_queue(queues["raw"])
            declare_queue(queues["raw"])
            encoded_times.append(raw_pika(messages, pre_encoded=True))
            delete_queue(queues["raw"])

            stage(url, n, queues["drain"])
            declare_queue(queues["drain"])
            elapsed, published = run_drain(url, args.batch_size)
            assert published == n, (published, n)
            drain_times.append(elapsed)
            delete_queue(queues["drain"])
            print(f"round {round_ + 1}: raw {n / raw_times[-1]:.0f} msg/s, "
                  f"raw pre-encoded {n / encoded_times[-1]:.0f} msg/s, "
                  f"drain {n / drain_times[-1]:.0f} msg/s", file=sys.stderr)
        results[raw_name] = (n, statistics.median(raw_times))
        results[encoded_name] = (n, statistics.median(encoded_times))
        results[drain_name] = (n, statistics.median(drain_times))

        cn = min(args.celery_jobs, n)
        results["celery send_task, confirm_publish=True"] = (
            cn, celery_send_task(cn, queues["celery"]))
        delete_queue(queues["celery"])
    finally:
        for q in queues.values():
            with contextlib.suppress(Exception):
                delete_queue(q)
        drop_database(db)

    rates = {name: count / seconds for name, (count, seconds) in results.items()}
    ceiling = rates[raw_name]
    celery = rates["celery send_task, confirm_publish=True"]
    print(f"\nthroughput, {n} jobs, median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} cores, loopback broker, persistent messages\n")
    w = max(len(name) for name in rates)
    print(f"| {'publisher':<{w}} | {'jobs':>7} | {'msg/s':>8} | {'x raw':>6} | {'x celery':>8} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
    for name, rate in rates.items():
        print(f"| {name:<{w}} | {results[name][0]:>7} | {rate:>8.0f} | "
              f"{rate / ceiling:>6.2f} | {rate / celery:>8.1f} |")
    drain_rate = next(r for k, r in rates.items() if k.startswith("drain"))
    target = 0.8
    verdict = "meets" if drain_rate >= target * ceiling else "MISSES"
    print(f"\ndrain / raw ceiling = {drain_rate / ceiling:.2f} ({verdict} the {target} target)")
    print(f"drain / raw with the drain's encoder = {drain_rate / rates[encoded_name]:.2f} "
          "(the drain's own overhead: Postgres fetch, delete and commit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
