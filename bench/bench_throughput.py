"""Throughput: the drain against the raw publish ceiling and Celery, in one run.

    python bench/bench_throughput.py [--jobs 200000] [--celery-jobs 5000] [--profile] [--smoke]

Measures, against the same local Postgres and RabbitMQ, one after the other,
each into its own fresh durable queue (deleted afterwards):

1. raw pika, pipelined publisher confirms with a sliding window of
   outstanding messages, publishing exactly the messages the drain would
   publish (built beforehand, not timed): at a window of 1,000 with pika's own
   property encoding, and with the drain's pre-encoded properties at every
   window of ``--windows`` (500 to 10,000). The best of all of them is the
   ceiling the drain is quoted against;
2. Celery ``send_task`` with ``broker_transport_options={'confirm_publish': True}``,
   what applications do today (on fewer jobs: it runs at ~700 msg/s);
3. the drain: N rows staged with COPY (not timed), then ``Drain.run`` until the
   table is empty (staged -> published -> confirmed -> deleted);
4. the drain with ``--app`` (``--apps``, default both): rows staged without a
   queue, routed by a Celery app (bench/bench_app.py) with plain mapping
   ``task_routes`` (cached per task) and with a router function (called per
   row), to the same kind of queue as the others, through the direct exchange
   Celery declares for it. They are quoted against raw pika through such an
   exchange too (pre-encoded, at the round's best window): a named exchange
   costs RabbitMQ more than the default one, whoever publishes.
5. OpenTelemetry (``--tracing``, bench/throughput_tracing.py): every row
   staged with its own request's context, drained without the SDK (``off``:
   headers forwarded), with the SDK sampling 1 % (parent-based) and 100 %,
   spans exported over OTLP/HTTP to a sink process; quoted against the plain
   drain of the same rounds (goals: off >= 0.99 x, 1 % >= 0.95 x).

Every drain round starts from a vacuumed table (the rows are staged, then
``VACUUM``), so that none inherits the dead rows of the round before it.

Raw pika and the drain alternate for ``--rounds`` rounds; medians are reported.
The goal: the drain at >= 0.9 x the raw rate and >= 8 x Celery, on a
200,000-row backlog; with ``--app`` and static routes, >= 0.9 x raw too.

``--profile`` adds one more drain round, not timed with the others: ``python -m
drain run --exit-when-empty`` as a subprocess under ``py-spy record --idle``
(wall-clock samples, waiting included), and prints where the time goes: the
top functions by own time, by cumulative time, and by drain function (the
deepest frame in the drain package, with the library calls it makes). The
collapsed stacks are kept in bench/results/throughput-profile.txt (feed them
to flamegraph.pl or speedscope). py-spy: ``pip install py-spy``.

Prints a table with rates and ratios and writes bench/results/throughput.json.
Never run by the tests, except ``--smoke``: 3,000 jobs (200 for Celery), one
round, no profile (py-spy may be missing), which checks that the bench works
(the figures mean nothing) and writes bench/results/throughput-smoke.json.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import cpu
import harness
import pika
import psycopg
import throughput_tracing
from harness import (
    BROKER_URL,
    declare_queue,
    declare_routed,
    delete_queue,
    delete_routed,
    stage,
)
from pika.adapters.select_connection import SelectConnection
from throughput_apps import (
    APPS,
    GOAL_JOBS,
    GOAL_X_RAW,
    ROUTED,
    app_round,
    app_rows,
    parse_apps,
    print_ratios,
    run_drain,
)
from throughput_profile import print_profile, profile_drain

from drain.broker.amqp import EncodedProperties
from drain.broker.outgoing import Message
from drain.celery import message
from drain.postgres.rows import StagedRow
from drain.settings import config
from drain.settings.urls import broker_parameters

WINDOW = 1000
#: The goal: a backlog this large, drained at these multiples of raw pika and Celery.
GOAL_X_CELERY = 8.0
RAW = "raw pika, pipelined confirms (window 1000)"
ENCODED = "raw pika, pre-encoded properties (as the drain)"
CELERY = "celery send_task, confirm_publish=True"
def raw_pika(messages: list[Message], *, pre_encoded: bool = False,
             window: int = WINDOW, routed_to: str = "", broker: str = BROKER_URL) -> float:
    """Publish with a sliding window of ``window`` unconfirmed messages; returns seconds.
    ``routed_to``: through that direct exchange to its queue (:func:`declare_routed`),
    as the --app rounds publish, instead of the default exchange. ``broker``: another
    broker's URL than the bench's (bench_cluster: a node of a cluster).

    ``pre_encoded`` hands pika the drain's precomputed property bytes instead of
    letting pika encode ``BasicProperties`` itself: the same wire bytes with less
    client CPU, which on a small machine leaves more CPU to the broker.

    Over many queues RabbitMQ confirms out of order (bench_curves' queues curve):
    the unconfirmed delivery tags are a set, not a count.
    """
    state: dict[str, Any] = {"next": 0, "t0": 0.0, "t1": 0.0}
    outstanding: set[int] = set()
    n = len(messages)

    def publish_more(channel: Any) -> None:
        while len(outstanding) < window and state["next"] < n:
            m = messages[state["next"]]
            properties = (
                EncodedProperties(m.encoded_properties) if pre_encoded
                else pika.BasicProperties(headers=m.headers, **m.properties)
            )
            channel.basic_publish(routed_to, routed_to or m.routing_key, m.body, properties,
                                  mandatory=True)
            state["next"] += 1
            outstanding.add(state["next"])  # delivery tags count from 1

    def on_confirm(frame: Any) -> None:
        tag, multiple = frame.method.delivery_tag, frame.method.multiple
        outstanding.difference_update([t for t in outstanding if t <= tag] if multiple
                                      else [tag])
        if not outstanding and state["next"] >= n:
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
        broker_parameters(broker),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_close_callback=lambda c, e: c.ioloop.stop(),
    )
    conn.ioloop.start()
    assert state["t1"], f"raw pika: {len(outstanding)} of {n} messages not confirmed"
    return float(state["t1"] - state["t0"])


def drain_round(url: str, n: int, size: tuple[int, int]) -> float:
    """``Drain.run`` over the ``n`` staged rows at ``size`` (batch, pipeline); its seconds."""
    elapsed, published = run_drain(url, *size)
    assert published == n, (published, n)
    return elapsed


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


def smoke(args: argparse.Namespace) -> None:
    """--smoke: tiny sizes, one round, no profile."""
    if args.profile:
        print("--smoke: no profile round", file=sys.stderr)
    args.jobs, args.celery_jobs, args.rounds, args.profile = 3000, 200, 1, False
    args.more = args.more or "500x2"


def parse_setting(text: str) -> tuple[int, int]:
    """``"1000x3"``: batch size 1000, pipeline 3."""
    batch, _, pipeline = text.partition("x")
    return int(batch), int(pipeline or config.DEFAULT_PIPELINE)


# -- results ----------------------------------------------------------------------------

def print_cpu(cpu_medians: dict[str, dict[str, float]], rates: dict[str, float]) -> None:
    """Where each run's CPU went (bench/cpu.py): on a saturated machine the
    rate follows the CPU all the processes spend per message."""
    print("\nCPU per message (microseconds, medians; this process is the publisher: "
          "pika, or the drain)\n")
    w = max(len(name) for name in cpu_medians)
    print(f"| {'publisher':<{w}} |    msg/s | publisher | RabbitMQ | Postgres |  all | "
          "machine busy |")
    print(f"|{'-' * (w + 2)}|---------:|----------:|---------:|---------:|-----:|"
          "-------------:|")
    for name, c in cpu_medians.items():
        print(f"| {name:<{w}} | {rates[name]:>8.0f} | {c['publisher_us']:>9.1f} | "
              f"{c['rabbitmq_us']:>8.1f} | {c['postgres_us']:>8.1f} | {c['all_us']:>4.0f} | "
              f"{100 * c['machine_busy']:>11.0f} % |")


def summary_rows(n: int, drain_rate: float, raw_rate: float, celery_rate: float) -> list[
        dict[str, Any]]:
    """The goal's two rows; ``met`` is None when the backlog was smaller than the goal's."""
    at_goal_size = n >= GOAL_JOBS
    size = "" if at_goal_size else f" (at {n:,} jobs: not the goal's size)"
    x_raw, x_celery = drain_rate / raw_rate, drain_rate / celery_rate
    return [
        {"target": "throughput vs raw pika",
         "goal": f">= {GOAL_X_RAW} x raw pika pipelined-confirm rate, "
                 f"{GOAL_JOBS:,}-row backlog staged -> deleted",
         "measured": f"{x_raw:.2f} x ({drain_rate:,.0f} vs {raw_rate:,.0f} msg/s){size}",
         "met": (x_raw >= GOAL_X_RAW) if at_goal_size else None},
        {"target": "throughput vs Celery",
         "goal": f">= {GOAL_X_CELERY:g} x Celery send_task, confirm_publish=True",
         "measured": f"{x_celery:.1f} x ({drain_rate:,.0f} vs {celery_rate:,.0f} msg/s){size}",
         "met": (x_celery >= GOAL_X_CELERY) if at_goal_size else None},
    ]


def print_rates(args: argparse.Namespace, rates: dict[str, float], counts: dict[str, int],
                best_raw: str) -> None:
    ceiling, celery, drain_rate = rates[best_raw], rates[CELERY], rates[
        f"drain run (batch {args.batch_size}, pipeline {args.pipeline}), staged -> deleted"]
    print(f"\nthroughput, {args.jobs} jobs, median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} cores, loopback broker, persistent messages\n")
    w = max(len(name) for name in rates)
    print(f"| {'publisher':<{w}} | {'jobs':>7} | {'msg/s':>8} | {'x raw':>6} | {'x celery':>8} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
    for name, rate in rates.items():
        print(f"| {name:<{w}} | {counts[name]:>7} | {rate:>8.0f} | "
              f"{rate / ceiling:>6.2f} | {rate / celery:>8.1f} |")
    print(f"\nthe ceiling: {best_raw}")
    print(f"drain / raw ceiling = {drain_rate / ceiling:.2f} (goal >= {GOAL_X_RAW}), "
          f"drain / celery = {drain_rate / celery:.1f} (goal >= {GOAL_X_CELERY:g})")


def print_overhead(rates: dict[str, float], drain_rate: float) -> None:
    """The drain against raw pika with the drain's encoder at the same window, when
    that window was measured (--windows may leave it out)."""
    same_window = rates.get(f"{ENCODED}, window {WINDOW}")
    if same_window:
        print(f"drain / raw with the drain's encoder at window {WINDOW} = "
              f"{drain_rate / same_window:.2f} "
              "(the drain's own overhead: Postgres fetch, delete and commit)")


def parse_args() -> argparse.Namespace:
    parser = harness.parser(__doc__, rounds=3)
    parser.add_argument("--jobs", type=int,
                        default=int(os.environ.get("BENCH_JOBS", str(GOAL_JOBS))),
                        help=f"backlog size (env BENCH_JOBS, default {GOAL_JOBS}: the goal's)")
    parser.add_argument("--celery-jobs", type=int, default=5000,
                        help="jobs for Celery send_task, which is slow (default 5000)")
    parser.add_argument("--batch-size", type=int, default=1000,
                        help="the drain's batch size quoted against the ceiling (default 1000)")
    parser.add_argument("--pipeline", type=int, default=config.DEFAULT_PIPELINE,
                        help="the drain's batches in flight quoted against the ceiling "
                        f"(default {config.DEFAULT_PIPELINE})")
    parser.add_argument("--more", default="",
                        help="other drain settings, BATCHxPIPELINE, to run in the same rounds "
                        "for comparison, e.g. 1000x2,5000x2")
    parser.add_argument("--windows", default="500,1000,2000,5000,10000",
                        help="confirm windows swept for raw pika with pre-encoded properties; "
                        "the best is the ceiling (default 500,1000,2000,5000,10000)")
    parser.add_argument("--profile", action="store_true",
                        help="one more drain round as a subprocess under py-spy: where the "
                        "time goes")
    parser.add_argument("--profile-rate", type=int, default=200, metavar="HZ",
                        help="py-spy samples per second (default 200)")
    parser.add_argument("--top", type=int, default=15, help="profile rows shown (default 15)")
    parser.add_argument("--tracing", type=throughput_tracing.parse_modes,
                        default=list(throughput_tracing.MODES),
                        help="OpenTelemetry rounds (bench/throughput_tracing.py), quoted "
                        "against the plain drain: off, 1%%, 100%% (default all; '' for none)")
    parser.add_argument("--apps", type=parse_apps, default=list(APPS),
                        help="drain --app rounds, routed by bench/bench_app.py's apps: "
                        "static (mapping task_routes), function (a router function); "
                        "'' for none (default static,function)")
    args = parser.parse_args()
    if args.smoke:
        smoke(args)
    return args


def prebuilt_messages(url: str, n: int, queue: str) -> list[Message]:
    """The exact messages the drain would publish, built from ``n`` staged rows
    (deleted afterwards)."""
    stage(url, n, queue)
    built = staged_messages(url)
    with psycopg.connect(url) as conn:
        conn.execute("DELETE FROM staged_jobs")
    return built


def staged_messages(url: str) -> list[Message]:
    """The exact messages the drain would publish for the rows staged now."""
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT id, task_id, task_name, args::text, kwargs::text, queue "
            "FROM staged_jobs ORDER BY id"
        ).fetchall()
    origin = message.origin()
    return [message.build(StagedRow(*r), origin=origin, reply_to=str(uuid.uuid4()))
            for r in rows]


def main() -> int:
    args = parse_args()
    n, apps = args.jobs, args.apps
    quoted = (args.batch_size, args.pipeline)
    sizes = list(dict.fromkeys([quoted, *(parse_setting(m) for m in args.more.split(",") if m)]))
    names = {(b, p): f"drain run (batch {b}, pipeline {p}), staged -> deleted" for b, p in sizes}
    windows = [int(w) for w in args.windows.split(",")]
    encoded = {w: f"{ENCODED}, window {w}" for w in windows}
    times = harness.Samples()  # seconds per round, by name
    cpu_used: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    counts: dict[str, int] = {}
    profile: dict[str, Any] | None = None
    spans: dict[str, list[int]] = collections.defaultdict(list)
    with harness.Setup("throughput") as setup, throughput_tracing.sink() as endpoint:
        url = setup.database()
        queues = {k: setup.queue(k, declare=False, routed=k == "app")
                  for k in ("raw", "celery", "drain", "app")}
        # bench_app reads it when the first --app round loads it.
        os.environ["BENCH_APP_QUEUE"] = queues["app"]
        messages = prebuilt_messages(url, n, queues["raw"])
        # The raw rounds' 200,000 prebuilt messages (a million objects) would
        # otherwise sit in the collector's oldest generation through every round
        # and make each full collection in the drain rounds walk them: +5 to 9 us
        # of drain CPU per message, a cost of the benchmark, not of the drain.
        gc.collect()
        gc.freeze()

        def timed(name: str, run: Callable[[], float], queue: str = "") -> None:
            """One timed run into a fresh ``queue`` (none: it declares its own), CPU too."""
            if queue:
                declare_queue(queue)
            before = cpu.sample()
            times.add(name, run())
            cpu_used[name].append(cpu.per_message(before, cpu.sample(), n))
            if queue:
                delete_queue(queue)

        def plain_rounds() -> None:
            for size in sizes:
                stage(url, n, queues["drain"], vacuum=True)
                timed(names[size], functools.partial(drain_round, url, n, size),
                      queues["drain"])

        def traced(mode: str) -> float:
            seconds, sdk = throughput_tracing.traced_round(url, n, mode, size=quoted,
                                                           endpoint=endpoint)
            spans[mode].append(sdk["spans_exported"])
            return seconds

        def tracing_rounds(round_: int) -> None:
            for mode in harness.turns(round_, args.tracing):
                throughput_tracing.stage_traced(url, n, queues["drain"], mode)
                timed(throughput_tracing.MODES[mode], functools.partial(traced, mode),
                      queues["drain"])

        def app_rounds() -> None:
            if apps:  # their ceiling: raw pika through the same kind of exchange
                best = min(windows, key=lambda w: times[encoded[w]][-1])
                declare_routed(queues["app"])
                times.add(ROUTED, raw_pika(messages, pre_encoded=True, window=best,
                                           routed_to=queues["app"]))
                delete_routed(queues["app"])
            for app in apps:
                times.add(APPS[app], app_round(url, n, queues["app"], app, size=quoted,
                                               cpu_used=cpu_used))

        for round_ in range(args.rounds):
            declare_queue(queues["raw"])
            times.add(RAW, raw_pika(messages))
            delete_queue(queues["raw"])
            for window in windows:
                timed(encoded[window], functools.partial(raw_pika, messages, pre_encoded=True,
                                                         window=window), queues["raw"])
            # The drain rounds, the tracing rounds and the --app rounds take turns
            # going first.
            parts: list[Callable[[], None]] = [
                plain_rounds, functools.partial(tracing_rounds, round_), app_rounds]
            for part in harness.turns(round_, parts):
                part()
            print(f"round {round_ + 1}: " + ", ".join(
                f"{name} {n / t[-1]:.0f}" for name, t in times.items()) + " msg/s",
                file=sys.stderr)
        messages.clear()  # 200,000 messages: free them before the Celery round
        counts[CELERY] = min(args.celery_jobs, n)
        times.add(CELERY, celery_send_task(counts[CELERY], queues["celery"]))
        delete_queue(queues["celery"])
        if args.profile:
            print("profile round: python -m drain run under py-spy", file=sys.stderr)
            profile = profile_drain(url, n, queues["drain"], batch_size=args.batch_size,
                                    pipeline=args.pipeline, rate=args.profile_rate,
                                    top=args.top)
    counts.update({name: n for name in times if name not in counts})
    rates = {name: counts[name] / seconds for name, seconds in times.medians().items()}
    drain_rate = rates[names[quoted]]
    best_raw = max((name for name in rates if name.startswith("raw pika") and name != ROUTED),
                   key=lambda name: rates[name])
    ceiling, celery = rates[best_raw], rates[CELERY]
    print_rates(args, rates, counts, best_raw)
    print_overhead(rates, drain_rate)
    print_ratios(rates, apps)
    cpu_medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                   for name, runs in cpu_used.items()}
    print_cpu(cpu_medians, rates)
    if profile is not None:
        print_profile(profile)
    summary = summary_rows(n, drain_rate, ceiling, celery)
    summary += app_rows(n, {app: rates[APPS[app]] for app in apps}, rates.get(ROUTED, ceiling))
    summary += throughput_tracing.rows(n, rates, drain_rate, args.tracing)
    per_round = {name: [round(n / t) for t in ts] for name, ts in times.items() if name != CELERY}
    harness.write_results("throughput", summary, smoke=args.smoke, details={
        "jobs": n,
        "celery_jobs": counts[CELERY],
        "batch_size": args.batch_size,
        "pipeline": args.pipeline,
        "rounds": args.rounds,
        "cores": os.cpu_count(),
        "msg_per_s": {name: round(rate) for name, rate in rates.items()},
        "rounds_msg_per_s": {
            "raw": per_round[RAW],
            "raw_pre_encoded": {w: per_round[encoded[w]] for w in windows},
            "drain": {f"{b}x{p}": per_round[names[b, p]] for b, p in sizes},
            "drain_app": {a: per_round[APPS[a]] for a in apps},
            "drain_tracing": {m: per_round[throughput_tracing.MODES[m]] for m in args.tracing},
            "raw_through_exchange": per_round.get(ROUTED, []),
        },
        "drain_x_raw": round(drain_rate / ceiling, 3),
        "ceiling": best_raw,
        "drain_x_celery": round(drain_rate / celery, 2),
        "cpu_per_message": cpu_medians,
        "profile": profile,
        # Spans the sink received per tracing round (a message's and the batches').
        "spans_exported": dict(spans),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
