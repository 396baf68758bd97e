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
   table is empty (staged -> published -> confirmed -> deleted).

Raw pika and the drain alternate for ``--rounds`` rounds; medians are reported.
The goal: the drain at >= 0.9 x the raw rate and >= 8 x Celery, on a
200,000-row backlog.

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
import contextlib
import dataclasses
import gc
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cpu
import pika
import psycopg
from pika.adapters.select_connection import SelectConnection

import drain
from drain import config, message, store
from drain.amqp import EncodedProperties
from drain.config import Settings
from drain.runner import Drain
from drain.urls import broker_parameters

ADMIN_URL = os.environ.get("DRAIN_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
WINDOW = 1000
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent
#: The goal: a backlog this large, drained at these multiples of raw pika and Celery.
GOAL_JOBS = 200_000
GOAL_X_RAW = 0.9
GOAL_X_CELERY = 8.0
RAW = "raw pika, pipelined confirms (window 1000)"
ENCODED = "raw pika, pre-encoded properties (as the drain)"
CELERY = "celery send_task, confirm_publish=True"


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


@contextlib.contextmanager
def broker_channel() -> Iterator[Any]:
    """A channel on a connection of its own, closed afterwards."""
    conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
    try:
        yield conn.channel()
    finally:
        conn.close()


def delete_queue(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_delete(queue)


def declare_queue(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_declare(queue, durable=True)


def stage(url: str, n: int, queue: str) -> None:
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"}, queue=queue)
                for i in range(n)
            ),
        )


def staged_count(url: str) -> int:
    """Rows in staged_jobs (the benches that wait for a drain to empty it)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else 0


def raw_pika(messages: list[message.Message], *, pre_encoded: bool = False,
             window: int = WINDOW) -> float:
    """Publish with a sliding window of ``window`` unconfirmed messages; returns seconds.

    ``pre_encoded`` hands pika the drain's precomputed property bytes instead of
    letting pika encode ``BasicProperties`` itself: the same wire bytes with less
    client CPU, which on a small machine leaves more CPU to the broker.
    """
    state: dict[str, Any] = {"next": 0, "acked": 0, "outstanding": 0, "t0": 0.0, "t1": 0.0}
    n = len(messages)

    def publish_more(channel: Any) -> None:
        while state["outstanding"] < window and state["next"] < n:
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


def parse_setting(text: str) -> tuple[int, int]:
    """``"1000x3"``: batch size 1000, pipeline 3."""
    batch, _, pipeline = text.partition("x")
    return int(batch), int(pipeline or config.DEFAULT_PIPELINE)


def run_drain(url: str, batch_size: int, pipeline: int) -> tuple[float, int]:
    d = Drain(Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch_size,
                       pipeline=pipeline),
              exit_when_empty=True)
    t0 = time.perf_counter()
    d.run()
    return time.perf_counter() - t0, d.published


# -- the profile round ------------------------------------------------------------------

#: "function (file:line)" as py-spy writes a frame.
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
DRAIN_FILE = re.compile(r"(^|/)drain/[^/]+\.py$")
#: Frames of the process's entry (runpy, the CLI): on every stack, they tell nothing.
ENTRY_FILE = re.compile(r"^<frozen runpy>$|(^|/)drain/(__main__|cli)\.py$")
#: Leaf frames that are the drain blocked on a socket, not working.
BROKER_WAIT = re.compile(r"^\w*Poller\.poll \(pika/")
POSTGRES_WAIT = re.compile(r"^(Connection\.wait \(psycopg/|wait\w* \(psycopg/waiting)")
NO_STACK = "(no Python stack)"
#: The root frame of every thread but the main one (the sampler, the HTTP server,
#: the watchdog): their idle waits are not the drain loop's.
THREAD_ROOT = re.compile(r"^(Thread\.)?_bootstrap \(.*threading\.py")
IMPORTS = "(start-up: imports)"


@dataclasses.dataclass(frozen=True)
class Frame:
    name: str  # "Store.fetch (drain/store.py)": the function, without the line
    file: str

    @property
    def ours(self) -> bool:
        return bool(DRAIN_FILE.search(self.file))


def _frame(text: str) -> Frame:
    match = FRAME.match(text)
    if match is None:
        return Frame(text, "")
    return Frame(f"{match['function']} ({match['file']})", match["file"])


def read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's ``--format raw`` output: one "frame;frame;...;frame count" line per stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks.append(([f for f in stack.split(";") if f.strip()], int(count)))
    return stacks


def _activity(frames: list[Frame], deepest_drain: Frame | None) -> str:
    """What the drain was doing in one sample, in a few coarse kinds."""
    names = [f.name for f in frames]
    if not any(name.startswith("Pipeline.cycle ") for name in names):
        return "outside the cycle: start-up, connecting, shut-down"
    leaf = names[-1]
    if BROKER_WAIT.match(leaf):
        return "idle: waiting on the broker socket (confirms)"
    if POSTGRES_WAIT.match(leaf):
        return "idle: waiting on Postgres (fetch, delete, commit)"
    where = deepest_drain.file if deepest_drain else ""
    if where.endswith(("drain/message.py", "drain/amqp.py")):
        return "CPU: building and encoding messages (drain.message, drain.amqp)"
    if where.endswith(("drain/store.py", "drain/keyset.py")):
        return "CPU: Postgres client (psycopg: send queries, adapt ids, parse rows)"
    if where.endswith(("drain/publisher.py", "drain/queue_declare.py", "drain/amqp_link.py")):
        return "CPU: pika (marshal frames, socket writes, read confirms)"
    return "CPU: the drain loop (runner, other)"


def where_the_time_goes(stacks: list[tuple[list[str], int]], top: int) -> dict[str, Any]:
    """Where the main thread's samples fall, four ways (other threads' are only counted).

    * by activity: waiting on the broker or Postgres versus CPU, by kind of work;
    * by drain function: the deepest frame in the drain package (its own code plus the
      library calls it makes, less deeper drain frames); imports are one bucket;
    * by own time: the sampled (leaf) frame;
    * by cumulative time: anywhere on the stack, once per stack (the entry frames,
      runpy and the CLI, left out).
    """
    activity: collections.Counter[str] = collections.Counter()
    by_drain: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    cumulative: collections.Counter[str] = collections.Counter()
    total = other_threads = 0
    for texts, count in stacks:
        if texts and THREAD_ROOT.match(texts[0]):
            other_threads += count
            continue
        total += count
        frames = [_frame(t) for t in texts]
        if not frames:
            for counter in (activity, by_drain, own, cumulative):
                counter[NO_STACK] += count
            continue
        deepest = next((f for f in reversed(frames) if f.ours), None)
        if any(f.name.startswith("_find_and_load ") for f in frames):
            activity[IMPORTS] += count
            by_drain[IMPORTS] += count
        else:
            activity[_activity(frames, deepest)] += count
            by_drain[deepest.name if deepest else "(no drain frame)"] += count
        own[frames[-1].name] += count
        for name in {f.name for f in frames if not ENTRY_FILE.search(f.file)}:
            cumulative[name] += count

    def rows(counter: collections.Counter[str], n: int) -> list[dict[str, Any]]:
        return [{"function": name, "samples": c, "percent": round(100 * c / max(total, 1), 1)}
                for name, c in counter.most_common(n)]

    return {"samples": total, "other_thread_samples": other_threads,
            "by_activity": rows(activity, len(activity)),
            "by_drain_function": rows(by_drain, top), "own": rows(own, top),
            "cumulative": rows(cumulative, top)}


def find_py_spy() -> str:
    """py-spy beside this interpreter (the venv) or on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("py-spy", path=path)
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy "
                         "(`make bench-profile` installs it into .venv)")
    return found


def profile_drain(url: str, n: int, queue: str, *, batch_size: int, pipeline: int,
                  rate: int, top: int) -> dict[str, Any]:
    """Drain ``n`` staged rows with ``python -m drain run`` under py-spy; where the time goes."""
    py_spy = find_py_spy()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "throughput-profile.txt"
    stage(url, n, queue)
    declare_queue(queue)
    command = [
        py_spy, "record", "--idle", "--format", "raw", "--rate", str(rate), "-o", str(out),
        "--", sys.executable, "-m", "drain", "run", "--exit-when-empty",
        "--database-url", url, "--broker-url", BROKER_URL, "--batch-size", str(batch_size),
        "--pipeline", str(pipeline),
    ]
    with tempfile.TemporaryFile("w+") as log_file:
        t0 = time.perf_counter()
        proc = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                              cwd=ROOT, check=False)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            log_file.seek(0)
            sys.stderr.write(log_file.read()[-4000:])
            raise SystemExit(f"the profiled drain failed (py-spy exit {proc.returncode}); "
                             "py-spy needs ptrace (root, or kernel.yama.ptrace_scope 0)")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None and row[0] == 0, f"{row} rows left staged after the profiled drain"
    delete_queue(queue)
    profile = where_the_time_goes(read_collapsed(out), top)
    return {
        "tool": f"py-spy record --idle --format raw --rate {rate} (wall clock, waiting included)",
        "jobs": n,
        "seconds": round(elapsed, 2),
        "msg_per_s": round(n / elapsed),
        "collapsed_stacks": str(out.relative_to(ROOT)),
        **profile,
    }


def print_profile(profile: dict[str, Any]) -> None:
    print(f"\nwhere the time goes: {profile['jobs']} jobs drained by `python -m drain run` "
          f"in {profile['seconds']} s ({profile['msg_per_s']} msg/s with process start-up and "
          f"sampling), {profile['samples']} samples of the main thread (the drain loop; "
          f"{profile['other_thread_samples']} of other threads left out), {profile['tool']}; "
          f"stacks in {profile['collapsed_stacks']}")
    for key, title in (("by_activity", "by activity"),
                       ("by_drain_function", "by drain function (with the library calls it makes)"),
                       ("own", "by own time (the sampled frame itself)"),
                       ("cumulative", "by cumulative time (anywhere on the stack, "
                                      "less the entry frames)")):
        rows = profile[key]
        w = max([len(title)] + [len(r["function"]) for r in rows])
        print(f"\n| {title:<{w}} |      % | samples |")
        print(f"|{'-' * (w + 2)}|{'-' * 8}|{'-' * 9}|")
        for r in rows:
            print(f"| {r['function']:<{w}} | {r['percent']:>6.1f} | {r['samples']:>7} |")


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


def write_results(data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{data['name']}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


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


def print_overhead(rates: dict[str, float], drain_rate: float) -> None:
    """The drain against raw pika with the drain's encoder at the same window, when
    that window was measured (--windows may leave it out)."""
    same_window = rates.get(f"{ENCODED}, window {WINDOW}")
    if same_window:
        print(f"drain / raw with the drain's encoder at window {WINDOW} = "
              f"{drain_rate / same_window:.2f} "
              "(the drain's own overhead: Postgres fetch, delete and commit)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    parser.add_argument("--rounds", type=int, default=3,
                        help="raw and drain alternate this many times; medians are reported")
    parser.add_argument("--profile", action="store_true",
                        help="one more drain round as a subprocess under py-spy: where the "
                        "time goes")
    parser.add_argument("--profile-rate", type=int, default=200, metavar="HZ",
                        help="py-spy samples per second (default 200)")
    parser.add_argument("--top", type=int, default=15, help="profile rows shown (default 15)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run without the profile (checks the bench works; no "
                        "figures)")
    args = parser.parse_args()
    if args.smoke:
        if args.profile:
            print("--smoke: no profile round", file=sys.stderr)
        args.jobs, args.celery_jobs, args.rounds, args.profile = 3000, 200, 1, False
        args.more = args.more or "500x2"
    n = args.jobs
    tag = uuid.uuid4().hex[:8]
    db = f"drain_bench_{tag}"
    url = fresh_database(db)
    queues = {k: f"bench_{k}_{tag}" for k in ("raw", "celery", "drain")}
    results: dict[str, tuple[int, float]] = {}
    quoted = (args.batch_size, args.pipeline)
    sizes = list(dict.fromkeys([
        quoted,
        *(parse_setting(m) for m in args.more.split(",") if m),
    ]))
    names = {(b, p): f"drain run (batch {b}, pipeline {p}), staged -> deleted"
             for b, p in sizes}
    drain_name = names[quoted]
    raw_times: list[float] = []
    windows = [int(w) for w in args.windows.split(",")]
    encoded_times: dict[int, list[float]] = {w: [] for w in windows}
    drain_times: dict[tuple[int, int], list[float]] = {b: [] for b in sizes}
    cpu_used: dict[str, list[dict[str, float]]] = collections.defaultdict(list)
    profile: dict[str, Any] | None = None
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
        del rows
        # The raw rounds' 200,000 prebuilt messages (a million objects) would
        # otherwise sit in the collector's oldest generation through every round
        # and make each full collection in the drain rounds walk them: +5 to 9 us
        # of drain CPU per message, a cost of the benchmark, not of the drain.
        gc.collect()
        gc.freeze()
        for round_ in range(args.rounds):
            declare_queue(queues["raw"])
            raw_times.append(raw_pika(messages))
            delete_queue(queues["raw"])
            for window in windows:
                declare_queue(queues["raw"])
                before = cpu.sample()
                encoded_times[window].append(raw_pika(messages, pre_encoded=True,
                                                      window=window))
                cpu_used[f"{ENCODED}, window {window}"].append(
                    cpu.per_message(before, cpu.sample(), n))
                delete_queue(queues["raw"])

            for size in sizes:
                stage(url, n, queues["drain"])
                declare_queue(queues["drain"])
                before = cpu.sample()
                elapsed, published = run_drain(url, *size)
                cpu_used[names[size]].append(cpu.per_message(before, cpu.sample(), n))
                assert published == n, (published, n)
                drain_times[size].append(elapsed)
                delete_queue(queues["drain"])
            sweep = ", ".join(f"{w}: {n / t[-1]:.0f}" for w, t in encoded_times.items())
            print(f"round {round_ + 1}: raw {n / raw_times[-1]:.0f} msg/s, "
                  f"raw pre-encoded by window {{{sweep}}} msg/s, "
                  "drain by batch x pipeline {"
                  + ", ".join(f"{b}x{p}: {n / t[-1]:.0f}" for (b, p), t in drain_times.items())
                  + "} msg/s", file=sys.stderr)
        del messages
        results[RAW] = (n, statistics.median(raw_times))
        for window, times in encoded_times.items():
            results[f"{ENCODED}, window {window}"] = (n, statistics.median(times))
        for size, times in drain_times.items():
            results[names[size]] = (n, statistics.median(times))

        cn = min(args.celery_jobs, n)
        results[CELERY] = (cn, celery_send_task(cn, queues["celery"]))
        delete_queue(queues["celery"])

        if args.profile:
            print("profile round: python -m drain run under py-spy", file=sys.stderr)
            profile = profile_drain(url, n, queues["drain"], batch_size=args.batch_size,
                                    pipeline=args.pipeline, rate=args.profile_rate,
                                    top=args.top)
    finally:
        for q in queues.values():
            with contextlib.suppress(Exception):
                delete_queue(q)
        drop_database(db)

    rates = {name: count / seconds for name, (count, seconds) in results.items()}
    raw_names = [name for name in rates if name.startswith("raw pika")]
    best_raw = max(raw_names, key=lambda name: rates[name])
    ceiling = rates[best_raw]
    celery = rates[CELERY]
    drain_rate = rates[drain_name]
    print(f"\nthroughput, {n} jobs, median of {args.rounds} alternating rounds, "
          f"{os.cpu_count()} cores, loopback broker, persistent messages\n")
    w = max(len(name) for name in rates)
    print(f"| {'publisher':<{w}} | {'jobs':>7} | {'msg/s':>8} | {'x raw':>6} | {'x celery':>8} |")
    print(f"|{'-' * (w + 2)}|{'-' * 9}|{'-' * 10}|{'-' * 8}|{'-' * 10}|")
    for name, rate in rates.items():
        print(f"| {name:<{w}} | {results[name][0]:>7} | {rate:>8.0f} | "
              f"{rate / ceiling:>6.2f} | {rate / celery:>8.1f} |")
    print(f"\nthe ceiling: {best_raw}")
    print(f"drain / raw ceiling = {drain_rate / ceiling:.2f} (goal >= {GOAL_X_RAW}), "
          f"drain / celery = {drain_rate / celery:.1f} (goal >= {GOAL_X_CELERY:g})")
    print_overhead(rates, drain_rate)
    cpu_medians = {name: {key: statistics.median(run[key] for run in runs) for key in runs[0]}
                   for name, runs in cpu_used.items()}
    print_cpu(cpu_medians, rates)
    if profile is not None:
        print_profile(profile)

    summary = summary_rows(n, drain_rate, ceiling, celery)
    path = write_results({
        "name": "throughput-smoke" if args.smoke else "throughput",
        "summary": [{**row, "met": None} for row in summary] if args.smoke else summary,
        "details": {
            "jobs": n,
            "celery_jobs": results[CELERY][0],
            "batch_size": args.batch_size,
            "pipeline": args.pipeline,
            "rounds": args.rounds,
            "cores": os.cpu_count(),
            "msg_per_s": {name: round(rate) for name, rate in rates.items()},
            "rounds_msg_per_s": {
                "raw": [round(n / t) for t in raw_times],
                "raw_pre_encoded": {w: [round(n / t) for t in times]
                                    for w, times in encoded_times.items()},
                "drain": {f"{b}x{p}": [round(n / t) for t in times]
                          for (b, p), times in drain_times.items()},
            },
            "drain_x_raw": round(drain_rate / ceiling, 3),
            "ceiling": best_raw,
            "drain_x_celery": round(drain_rate / celery, 2),
            "cpu_per_message": cpu_medians,
            "profile": profile,
        },
    })
    print(f"\nwrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
