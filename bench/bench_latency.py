"""Latency: staging COMMIT -> broker confirm, at a steady 1,000, 200 and 50 jobs/s.

    python bench/bench_latency.py [--rates 1000,200,50] [--duration 20] [--warmup 2]
                                  [--stagers auto] [--plain] [--no-consumer]
                                  [--drain-args "--poll-interval 1.0"]
                                  [--wait-quiet SECONDS] [--smoke]

Target: at a steady rate of single-row staging transactions, the time from the
staging COMMIT to the broker's confirm of that job's message is p50 <= 5 ms and
p99 <= 50 ms. 200 jobs/s comes from one stager; at 50 jobs/s the drain is
mostly idle, armed between jobs, and its wake-up (drain.postgres.wakeup) decides the
latency.

Set-up: a fresh database migrated with ``drain.postgres.store.migrate``, a fresh durable
queue, and the drain as a separate process (``drain run``, the thing measured),
started once and kept for all the rates, as in production. Stager processes
(``--stagers``; by default one per 500 jobs/s) commit one ``drain.stage()`` per
transaction on an open-loop schedule: job i is due at t0 + i/rate, and a stager
that falls behind catches up at once instead of silently lowering the offered
rate; the achieved rate and the schedule lag are reported. Each stager records
``time.time()`` right after its COMMIT returns, keyed by the job's task id. The
first ``--warmup`` seconds of each rate are discarded.

Two measurements, on this machine's one clock (``time.time()``, i.e.
CLOCK_REALTIME, read in different processes):

* **commit -> confirm** (the target), read inside the drain process: by
  default the drain runs as ``python bench/bench_latency.py --drain-probe run
  ...``, which is exactly ``drain run`` (``drain.cli.main.main``) with timestamping
  wrappers around a few methods: the broker's ``basic.ack`` callback, fetch,
  publish, the wait for confirms, the batch transaction and the idle wait.
  Each appends one tuple per call and everything is written to a JSON file at
  exit; the drain's logic is unchanged. "Confirm" is the moment the drain
  handles the ``basic.ack`` (the broker sent it earlier, by up to the time the
  drain takes to turn its I/O loop). The same records split each job's
  latency into commit -> fetched -> handed to pika -> confirmed -> row deleted,
  which the diagnosis below the figures uses. ``--plain`` runs the unmodified
  ``python -m drain run`` instead; then only the consumer figure exists.
* **commit -> delivery to a consumer**: a pika consumer in its own process
  (``basic_consume``, ``auto_ack``, so no prefetch limit) records
  ``time.time()`` when each message arrives and finds the job by its task id
  (the Celery v2 message's ``correlation_id`` / ``id`` header). This is the
  external view of the same path. It bounds the *routing* of the message, not
  the confirm: RabbitMQ confirms a persistent message to a durable queue only
  once the queue has written it (or a consumer has acked it), which can come
  after the delivery, and the drain sees the confirm only when it next turns
  its I/O loop. So both are printed. ``--no-consumer`` leaves the queue
  without a consumer (messages pile up and are written to disk), which shows
  the confirm on the disk path.

Every committed job must be confirmed (probe), delivered (consumer) and gone
from ``staged_jobs`` at the end; ``lost`` counts the jobs that were not.

``--wait-quiet SECONDS`` waits for other work on the machine to stop first.

Caveats: two shared cores run the stagers, the drain, Postgres, RabbitMQ and
the consumer, so scheduling delays land in both directions (a late commit
timestamp shortens a latency, a late delivery timestamp lengthens it); the
machine's CPU use during each window is printed. A job is visible to the drain
a moment before its COMMIT returns to the stager, so a latency can be slightly
negative. Runs are short: treat the tails as noisy.

Writes ``bench/results/latency.json``. Never run by the tests, except
``--smoke``: 200 jobs/s for 0.5 s + 2 s, which checks that the bench works (the
figures mean nothing; it fails if nothing was measured) and writes
``bench/results/latency-smoke.json``.
"""

from __future__ import annotations

import argparse
import atexit
import collections
import contextlib
import dataclasses
import itertools
import json
import math
import multiprocessing as mp
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

P50_GOAL_MS = 5.0
P99_GOAL_MS = 50.0
TASK_NAME = "bench.latency"

#: (task_id, seq, due, t_begin, t_committed), one per staged job.
StagedRecord = tuple[str, int, float, float, float]


# -- inside the drain subprocess: the probe -------------------------------------------


def drain_probe(argv: list[str]) -> int:
    """``drain run`` (drain.cli.main.main) with timestamps on a few methods, dumped at exit.

    Each wrapper reads time.time() and appends one tuple; the drain's own code
    runs unchanged. The dump goes to the file named by $BENCH_LATENCY_PROBE.
    """
    from drain.broker.publisher import Publisher
    from drain.cli import main as cli
    from drain.postgres.store import Store

    out_path = os.environ["BENCH_LATENCY_PROBE"]
    rec: dict[str, list[Any]] = {
        "fetch": [],    # (t_before, t_after, [(row_id, task_id)])
        "publish": [],  # (t_before, t_after, generation, base_tag, [task_id])
        "confirm": [],  # (t, generation, delivery_tag, multiple, ack)
        "wait": [],     # (t_before, t_after, batch_size)
        "tx": [],       # (t_begin, t_committed, [deleted row ids])
        "idle": [],     # (t_before, t_after, notified, NOTIFYs waiting at the start)
        "query": [],    # (t_before, t_after, query name): every statement but BEGIN/COMMIT
    }
    now = time.time
    deleting: list[int] = []
    fetch_before, start_before = Store.fetch, Publisher.start
    confirm_before, wait_before = Publisher._on_confirm, Publisher.wait
    batch_before, delete_before, idle_before = Store.batch, Store.delete, Store.wait
    execute_before, notified_before = Store._execute, Store._notified
    # NOTIFYs each Store._notified call took (psycopg's Connection.notifies), since
    # the idle wait began.
    taken: list[int] = []

    def fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        rows = fetch_before(self, *args, **kwargs)
        rec["fetch"].append((t0, now(), [(r.id, r.task_id) for r in rows]))
        return rows

    def start(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        batch = start_before(self, *args, **kwargs)
        rec["publish"].append((t0, now(), batch.generation, batch.base,
                               [m.task_id for m in batch.messages]))
        return batch

    def on_confirm(self: Any, frame: Any) -> None:
        method = frame.method
        rec["confirm"].append((now(), self._generation, method.delivery_tag,
                               bool(method.multiple), type(method).__name__ == "Ack"))
        confirm_before(self, frame)

    def wait(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        result = wait_before(self, batch, *args, **kwargs)
        rec["wait"].append((t0, now(), len(batch.status)))
        return result

    @contextlib.contextmanager
    def batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        deleting.clear()
        with batch_before(self, *args, **kwargs):
            yield
        rec["tx"].append((t0, now(), list(deleting)))

    def delete(self: Any, rows: Mapping[int, int], *args: Any, **kwargs: Any) -> Any:
        deleting.extend(rows)  # {id: xact}: the ids
        return delete_before(self, rows, *args, **kwargs)

    def notified(self: Any, conn: Any) -> Any:
        counting = CountingNotifies(conn)
        proxy: Any = counting  # stands in for the psycopg connection
        try:
            return notified_before(self, proxy)
        finally:
            taken.append(counting.count)

    def idle(self: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        taken.clear()
        notified = idle_before(self, *args, **kwargs)
        # The wait first takes, without blocking, the NOTIFYs that arrived while the
        # connection ran the batch's queries (psycopg keeps them) or sit unread.
        queued = taken[0] if taken else 0
        rec["idle"].append((t0, now(), notified, queued))
        return notified

    def execute(self: Any, name: str, *args: Any, **kwargs: Any) -> Any:
        t0 = now()
        cursor = execute_before(self, name, *args, **kwargs)
        rec["query"].append((t0, now(), name))
        return cursor

    Store._execute = execute  # type: ignore[method-assign]
    Store.fetch = fetch  # type: ignore[method-assign]
    Publisher.start = start  # type: ignore[method-assign]
    Publisher._on_confirm = on_confirm  # type: ignore[method-assign]
    Publisher.wait = wait  # type: ignore[method-assign]
    Store.batch = batch  # type: ignore[method-assign]
    Store.delete = delete  # type: ignore[method-assign]
    Store.wait = idle  # type: ignore[method-assign]
    Store._notified = notified  # type: ignore[method-assign]

    def dump() -> None:
        data = dict(rec)
        data["fetch"] = [(a, b, [(i, str(t)) for i, t in rows]) for a, b, rows in rec["fetch"]]
        with open(out_path + ".tmp", "w") as f:
            json.dump(data, f)
        os.replace(out_path + ".tmp", out_path)

    atexit.register(dump)
    return int(cli.main(argv))


class CountingNotifies:
    """A psycopg connection whose ``notifies()`` counts the notifications it yields."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.count = 0

    def notifies(self, **kwargs: Any) -> Iterator[Any]:
        for note in self.conn.notifies(**kwargs):
            self.count += 1
            yield note

    def __getattr__(self, name: str) -> Any:
        return getattr(self.conn, name)


# -- the consumer and the stagers (child processes) ------------------------------------


def consumer_process(broker_url: str, queue: str, ready: Any, stop: Any, out: Any) -> None:
    """Record time.time() at each delivery, by task id; send {task_id: [t, ...]} at the end."""
    import pika

    from drain.settings.urls import broker_parameters

    got: dict[str, list[float]] = {}
    conn = pika.BlockingConnection(broker_parameters(broker_url))
    channel = conn.channel()

    def on_message(_ch: Any, _method: Any, properties: Any, _body: bytes) -> None:
        t = time.time()
        task_id = properties.correlation_id or (properties.headers or {}).get("id")
        got.setdefault(str(task_id), []).append(t)

    channel.basic_consume(queue, on_message, auto_ack=True)
    ready.set()
    while not stop.is_set():
        conn.process_data_events(time_limit=0.2)
    conn.process_data_events(time_limit=0.2)
    with contextlib.suppress(Exception):
        conn.close()
    out.send(got)
    out.close()


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rate's open-loop schedule: job ``seq`` is due at ``t0 + seq / rate``."""

    url: str
    queue: str
    rate: float
    t0: float
    jobs: int
    stagers: int

    @property
    def phase(self) -> str:
        return f"r{self.rate:g}"


def stager_process(schedule: Schedule, index: int, out: Any) -> None:
    """Stage jobs index, index + stagers, ... at their due times, one per transaction.

    Sends [(task_id, seq, due, t_begin, t_committed)] at the end.
    """
    import psycopg

    import drain

    records: list[StagedRecord] = []
    with psycopg.connect(schedule.url) as conn:
        conn.execute("SELECT 1")
        conn.commit()
        for seq in range(index, schedule.jobs, schedule.stagers):
            due = schedule.t0 + seq / schedule.rate
            delay = due - time.time()
            if delay > 0:
                time.sleep(delay)
            begin = time.time()
            task_id = drain.stage(conn, TASK_NAME, [schedule.phase, seq], queue=schedule.queue)
            conn.commit()
            records.append((str(task_id), seq, due, begin, time.time()))
    out.send(records)
    out.close()


# -- statistics -----------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values_ms: list[float]) -> dict[str, Any]:
    v = sorted(values_ms)
    if not v:
        return {"count": 0}
    return {
        "count": len(v),
        "min": v[0],
        "p50": percentile(v, 50),
        "p90": percentile(v, 90),
        "p99": percentile(v, 99),
        "p99.9": percentile(v, 99.9),
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"p50": percentile(v, 50), "p99": percentile(v, 99),
            "max": v[-1] if v else math.nan}


BUCKETS_MS = (0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)


def histogram(values_ms: list[float]) -> list[tuple[str, int]]:
    """Counts per bucket of BUCKETS_MS, empty buckets at both ends left out."""
    counts = [0] * (len(BUCKETS_MS) + 1)
    for x in values_ms:
        counts[sum(1 for edge in BUCKETS_MS if x >= edge)] += 1
    labels = [f"< {BUCKETS_MS[0]:g}"]
    labels += [f"{a:g}-{b:g}" for a, b in itertools.pairwise(BUCKETS_MS)]
    labels += [f">= {BUCKETS_MS[-1]:g}"]
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return []
    return [(labels[i], counts[i]) for i in range(used[0], used[-1] + 1)]


def print_histogram(rows: list[tuple[str, int]], width: int = 50) -> None:
    if not rows:
        return
    top = max(c for _, c in rows)
    total = sum(c for _, c in rows)
    for label, c in rows:
        bar = "#" * max(1 if c else 0, round(width * c / top))
        print(f"    {label:>10} ms | {c:>6} {100 * c / total:5.1f}% {bar}")


def fmt(d: dict[str, Any]) -> str:
    if not d.get("count"):
        return "no samples"
    return (f"n={d['count']}  p50 {d['p50']:.2f}  p90 {d['p90']:.2f}  p99 {d['p99']:.2f}  "
            f"p99.9 {d['p99.9']:.2f}  max {d['max']:.2f}  (min {d['min']:.2f}) ms")


def verdict(d: dict[str, Any]) -> bool | None:
    if not d.get("count"):
        return None
    return bool(d["p50"] <= P50_GOAL_MS and d["p99"] <= P99_GOAL_MS)


# -- CPU accounting -------------------------------------------------------------------


def proc_cpu_seconds(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def proc_rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def machine_jiffies() -> tuple[float, float] | None:
    """(busy, total) jiffies of all cores, from /proc/stat."""
    try:
        with open("/proc/stat") as f:
            parts = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return float(sum(parts) - idle), float(sum(parts))


# -- the probe's records -> per-job timelines ------------------------------------------


def confirm_times(probe: dict[str, Any]) -> dict[int, dict[int, tuple[float, bool]]]:
    """generation -> delivery tag -> (time the drain handled its ack/nack, acked)."""
    frames: dict[int, list[tuple[float, int, bool, bool]]] = collections.defaultdict(list)
    for t, gen, tag, multiple, ack in probe["confirm"]:
        frames[gen].append((t, tag, multiple, ack))
    out: dict[int, dict[int, tuple[float, bool]]] = {}
    for gen, fs in frames.items():
        resolved: dict[int, tuple[float, bool]] = {}
        low = 1
        for t, tag, multiple, ack in fs:
            # A 'multiple' ack covers every tag up to its own not resolved yet.
            for k in range(low if multiple else tag, tag + 1):
                resolved.setdefault(k, (t, ack))
            if multiple:
                low = max(low, tag + 1)
        out[gen] = resolved
    return out


def probe_timelines(probe: dict[str, Any]) -> dict[str, dict[str, float]]:
    """task_id -> first fetch_start, fetched, published, confirmed, deleted times."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    row_task: dict[int, str] = {}
    for t0, t1, rows in probe["fetch"]:
        for row_id, task_id in rows:
            row_task[row_id] = task_id
            out[task_id].setdefault("fetch_start", t0)
            out[task_id].setdefault("fetched", t1)
    confirmed = confirm_times(probe)
    for _t0, t1, gen, base, task_ids in probe["publish"]:
        acks = confirmed.get(gen, {})
        for i, task_id in enumerate(task_ids):
            job = out[task_id]
            job.setdefault("published", t1)
            hit = acks.get(base + i + 1)
            if hit is not None and hit[1]:
                job.setdefault("confirmed", hit[0])
    for _t0, t1, deleted in probe["tx"]:
        for row_id in deleted:
            if row_id in row_task:
                out[row_task[row_id]].setdefault("deleted", t1)
    return dict(out)


def probe_loop(probe: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """What the drain's loop did between start and end: batch sizes, waits, wake-ups."""
    def within(key: str) -> list[Any]:
        return [r for r in probe[key] if start <= r[0] < end]

    fetched = [len(rows) for _t0, _t1, rows in within("fetch")]
    queries: dict[str, list[float]] = collections.defaultdict(list)
    for t0, t1, name in within("query"):
        queries[name].append(1000 * (t1 - t0))
    idles = within("idle")
    return {
        "transactions": len(within("tx")),
        "fetches": len(fetched),
        "empty_fetches": sum(1 for n in fetched if n == 0),
        "rows_per_nonempty_fetch": quantiles([n for n in fetched if n]),
        "transaction_ms": quantiles([1000 * (t1 - t0) for t0, t1, _ in within("tx")]),
        "confirm_wait_ms": quantiles([1000 * (t1 - t0) for t0, t1, _ in within("wait")]),
        "idle_waits": len(idles),
        "idle_waits_ended_by_notify": sum(1 for i in idles if i[2]),
        "idle_wait_ms": quantiles([1000 * (i[1] - i[0]) for i in idles]),
        # NOTIFYs already waiting (received during other queries) at each idle wait.
        "notifies_queued_at_idle": quantiles([i[3] for i in idles if len(i) > 3]),
        "queries_ms": {
            name: {"count": len(times), **quantiles(times)}
            for name, times in sorted(queries.items())
        },
    }


# -- running one rate -------------------------------------------------------------------


@dataclasses.dataclass
class Phase:
    schedule: Schedule
    warmup: float
    duration: float
    records: list[StagedRecord]
    drain_cpu: float | None
    machine_busy: float | None
    #: The machine's busy fraction just before the stagers started (--wait-quiet).
    busy_before: float | None = None
    #: The drain's resident memory (KiB) at the start and end of the measured window.
    rss: tuple[int | None, int | None] = (None, None)


def run_phase(schedule: Schedule, warmup: float, duration: float, drain_pid: int) -> Phase:
    ctx = mp.get_context("fork")
    pipes, procs = [], []
    for k in range(schedule.stagers):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=stager_process, args=(schedule, k, send), daemon=True)
        p.start()
        send.close()
        pipes.append(recv)
        procs.append(p)
    # CPU use over the measured window.
    window = (schedule.t0 + warmup, schedule.t0 + warmup + duration)
    time.sleep(max(0.0, window[0] - time.time()))
    cpu0, jiffies0 = proc_cpu_seconds(drain_pid), machine_jiffies()
    rss0 = proc_rss_kib(drain_pid)
    time.sleep(max(0.0, window[1] - time.time()))
    cpu1, jiffies1 = proc_cpu_seconds(drain_pid), machine_jiffies()
    rss1 = proc_rss_kib(drain_pid)
    records: list[StagedRecord] = []
    for recv, p in zip(pipes, procs, strict=True):
        records.extend(recv.recv())
        p.join(timeout=30)
    records.sort(key=lambda r: r[1])
    drain_cpu = (cpu1 - cpu0) / duration if cpu0 is not None and cpu1 is not None else None
    busy = None
    if jiffies0 and jiffies1 and jiffies1[1] > jiffies0[1]:
        busy = (jiffies1[0] - jiffies0[0]) / (jiffies1[1] - jiffies0[1])
    return Phase(schedule, warmup, duration, records, drain_cpu, busy, rss=(rss0, rss1))


def analyse(phase: Phase, delivered: dict[str, list[float]] | None,
            timelines: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """The figures of one rate; keys starting with '_' are raw values, not saved."""
    records = phase.records
    measured = [r for r in records if r[2] >= phase.schedule.t0 + phase.warmup]
    commits = [r[4] for r in measured]
    span = (max(commits) - min(commits)) if len(commits) > 1 else 0.0
    result: dict[str, Any] = {
        "rate_offered": phase.schedule.rate,
        "stagers": phase.schedule.stagers,
        "committed_total": len(records),
        "measured_jobs": len(measured),
        "rate_achieved": (len(commits) - 1) / span if span > 0 else math.nan,
        "schedule_lag_ms": quantiles([1000 * (r[3] - r[2]) for r in measured]),
        "stager_insert_commit_ms": quantiles([1000 * (r[4] - r[3]) for r in measured]),
        "drain_cpu_fraction": phase.drain_cpu,
        "machine_cpu_busy_fraction": phase.machine_busy,
        "machine_cpu_busy_before_fraction": phase.busy_before,
        "drain_rss_kib": {"start": phase.rss[0], "end": phase.rss[1]},
    }
    missing: set[str] = set()
    if delivered is not None:
        lat = [1000 * (delivered[r[0]][0] - r[4]) for r in measured if r[0] in delivered]
        result["commit_to_delivery_ms"] = distribution(lat)
        result["commit_to_delivery_histogram"] = histogram(lat)
        undelivered = {r[0] for r in records if r[0] not in delivered}
        result["not_delivered"] = len(undelivered)
        missing |= undelivered
        result["duplicates_delivered"] = sum(
            len(delivered[r[0]]) - 1 for r in records if r[0] in delivered)
    if timelines is not None:
        def span_ms(a: str, b: str) -> list[float]:
            out = []
            for r in measured:
                job = timelines.get(r[0], {})
                begin = r[4] if a == "commit" else job.get(a)
                end = job.get(b)
                if begin is not None and end is not None:
                    out.append(1000 * (end - begin))
            return out

        confirm = span_ms("commit", "confirmed")
        result["commit_to_confirm_ms"] = distribution(confirm)
        result["commit_to_confirm_histogram"] = histogram(confirm)
        unconfirmed = {r[0] for r in records if "confirmed" not in timelines.get(r[0], {})}
        result["not_confirmed"] = len(unconfirmed)
        missing |= unconfirmed
        result["breakdown_ms"] = {
            "commit -> fetch starts": distribution(span_ms("commit", "fetch_start")),
            "fetch (query)": distribution(span_ms("fetch_start", "fetched")),
            "fetched -> handed to pika": distribution(span_ms("fetched", "published")),
            "handed to pika -> confirm seen": distribution(span_ms("published", "confirmed")),
            "confirm -> row deleted (committed)": distribution(span_ms("confirmed", "deleted")),
            "commit -> row deleted (committed)": distribution(span_ms("commit", "deleted")),
        }
    # Committed jobs that were not confirmed (probe) or not delivered (consumer).
    result["lost"] = len(missing)
    return result


# -- the whole run ---------------------------------------------------------------------


#: --wait-quiet: the machine counts as quiet below this fraction of all cores busy.
QUIET_BUSY = 0.25


def wait_quiet(limit: float) -> float | None:
    """Wait up to ``limit`` seconds for a quiet machine; returns the last busy fraction
    (over 2 s, before this bench's own stagers start; the idle drain is included)."""
    give_up = time.time() + limit
    busy = None
    while limit > 0:
        a = machine_jiffies()
        time.sleep(2.0)
        b = machine_jiffies()
        if a is None or b is None or b[1] <= a[1]:
            return None
        busy = (b[0] - a[0]) / (b[1] - a[1])
        if busy < QUIET_BUSY or time.time() >= give_up:
            break
    return busy


def wait_for_log(path: str, needle: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        with open(path, errors="replace") as f:
            if needle in f.read():
                return
        time.sleep(0.05)
    with open(path, errors="replace") as f:
        raise SystemExit(f"the drain did not log {needle!r} within {timeout:g}s:\n{f.read()}")


def staged_count(url: str) -> int:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(str(row[0])) if row else 0


def wait_empty(url: str, timeout: float, proc: subprocess.Popen[bytes]) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if staged_count(url) == 0:
            return True
        time.sleep(0.1)
    return False


def start_consumer(broker_url: str, queue: str, stop: Any) -> tuple[Any, Any]:
    """The consumer process, consuming, and the end of the pipe it reports on."""
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    recv, send = ctx.Pipe(duplex=False)
    consumer = ctx.Process(target=consumer_process,
                           args=(broker_url, queue, ready, stop, send), daemon=True)
    consumer.start()
    send.close()
    if not ready.wait(15):
        consumer.kill()
        raise SystemExit("the consumer did not start")
    return consumer, recv


@dataclasses.dataclass
class Outcome:
    phases: list[Phase]
    delivered: dict[str, list[float]] | None
    probe: dict[str, Any] | None
    left_staged: int


def one_rate(args: argparse.Namespace, rate: float, url: str, queue: str, *,
             drain_proc: subprocess.Popen[bytes], log_path: str) -> Phase:
    """Stage at ``rate`` for the warm-up and the measured window; wait for the drain."""
    stagers = max(1, math.ceil(rate / 500)) if args.stagers == "auto" else int(args.stagers)
    before = wait_quiet(args.wait_quiet)
    print(f"{rate:g} jobs/s: {args.warmup:g}s warm-up + {args.duration:g}s measured, "
          f"{stagers} stager process(es)"
          + (f", machine {100 * before:.0f}% busy before" if before is not None else "")
          + "...", file=sys.stderr)
    schedule = Schedule(url, queue, rate, time.time() + 0.5 + 0.05 * stagers,
                        round(rate * (args.warmup + args.duration)), stagers)
    phase = run_phase(schedule, args.warmup, args.duration, drain_proc.pid)
    phase.busy_before = before
    if not wait_empty(url, 60, drain_proc):
        print("  staged_jobs not empty 60 s after the last commit", file=sys.stderr)
    if drain_proc.poll() is not None:
        with open(log_path, errors="replace") as f:
            raise SystemExit(f"the drain exited ({drain_proc.returncode}):\n{f.read()}")
    time.sleep(1.0)
    return phase


def run(args: argparse.Namespace, rates: list[float]) -> Outcome:
    sys.path.insert(0, HERE)
    from harness import (
        BROKER_URL,
        declare_queue,
        delete_queue,
        drop_database,
        fresh_database,
    )

    tag = uuid.uuid4().hex[:8]
    db, queue = f"drain_bench_latency_{tag}", f"bench_latency_{tag}"
    url = fresh_database(db)
    declare_queue(queue)
    workdir = tempfile.mkdtemp(prefix="bench_latency_")
    probe_path = os.path.join(workdir, "probe.json")
    log_path = os.path.join(workdir, "drain.log")
    drain_argv = ["run", "--database-url", url, "--broker-url", BROKER_URL,
                  *shlex.split(args.drain_args)]
    if args.plain:
        cmd = [sys.executable, "-m", "drain", *drain_argv]
    else:
        cmd = [sys.executable, os.path.abspath(__file__), "--drain-probe", *drain_argv]
    env = {**os.environ, "BENCH_LATENCY_PROBE": probe_path,
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ctx = mp.get_context("fork")
    stop = ctx.Event()
    consumer: Any = None
    consumer_recv: Any = None
    drain_proc: subprocess.Popen[bytes] | None = None
    outcome = Outcome([], None, None, -1)
    try:
        if not args.no_consumer:
            consumer, consumer_recv = start_consumer(BROKER_URL, queue, stop)
        with open(log_path, "wb") as log_file:
            drain_proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                          env=env, cwd=ROOT)
        wait_for_log(log_path, "broker connected", drain_proc, 30)
        print(f"drain: pid {drain_proc.pid}, {' '.join(cmd[1:3])} ..."
              + (f", log {log_path}" if args.keep_logs else ""), file=sys.stderr)
        for rate in rates:
            outcome.phases.append(one_rate(args, rate, url, queue, drain_proc=drain_proc,
                                           log_path=log_path))
        outcome.left_staged = staged_count(url)
        drain_proc.send_signal(signal.SIGTERM)
        drain_proc.wait(timeout=30)
        if consumer is not None:
            time.sleep(0.5)
            stop.set()
            outcome.delivered = consumer_recv.recv()
            consumer.join(timeout=10)
        if not args.plain:
            with open(probe_path) as f:
                outcome.probe = json.load(f)
    finally:
        if drain_proc is not None and drain_proc.poll() is None:
            drain_proc.kill()
            drain_proc.wait()
        stop.set()
        if consumer is not None and consumer.is_alive():
            consumer.join(timeout=5)
            if consumer.is_alive():
                consumer.kill()
        with contextlib.suppress(Exception):
            delete_queue(queue)
        with contextlib.suppress(Exception):
            drop_database(db)
        if not args.keep_logs:
            shutil.rmtree(workdir, ignore_errors=True)
    return outcome


def report(r: dict[str, Any], left_staged: int) -> None:
    lag, commit = r["schedule_lag_ms"], r["stager_insert_commit_ms"]
    print(f"\n== {r['rate_offered']:g} jobs/s offered, {r['stagers']} stager(s): achieved "
          f"{r['rate_achieved']:.1f} jobs/s over {r['measured_jobs']} measured jobs "
          f"({r['committed_total']} committed with the warm-up)")
    print(f"   stagers: schedule lag p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max "
          f"{lag['max']:.1f} ms; INSERT+COMMIT p50 {commit['p50']:.2f} ms, p99 "
          f"{commit['p99']:.2f} ms")
    cpu, busy = r["drain_cpu_fraction"], r["machine_cpu_busy_fraction"]
    if cpu is not None and busy is not None:
        before = r.get("machine_cpu_busy_before_fraction")
        print(f"   drain process CPU {100 * cpu:.0f}% of one core; whole machine "
              f"{100 * busy:.0f}% busy ({os.cpu_count()} cores)"
              + (f", {100 * before:.0f}% just before" if before is not None else ""))
    rss = r["drain_rss_kib"]
    if rss["start"] is not None and rss["end"] is not None:
        print(f"   drain resident memory {rss['start'] / 1024:.1f} MiB -> "
              f"{rss['end'] / 1024:.1f} MiB over the measured window"
              + (" (the probe's own records included)" if "drain_loop" in r else ""))
    for key, title in (("commit_to_confirm", "commit -> confirm (seen by the drain)"),
                       ("commit_to_delivery", "commit -> delivery to a consumer")):
        if f"{key}_ms" not in r:
            continue
        d = r[f"{key}_ms"]
        mark = {True: "MET", False: "NOT MET", None: "n/a"}[verdict(d)]
        print(f"   {title}: {fmt(d)}")
        print(f"     goal p50 <= {P50_GOAL_MS:g} ms and p99 <= {P99_GOAL_MS:g} ms: {mark}")
        print_histogram(r[f"{key}_histogram"])
    if "breakdown_ms" in r:
        print("   where the time goes (per job, ms):")
        for name, d in r["breakdown_ms"].items():
            if d.get("count"):
                print(f"     {name:<36} p50 {d['p50']:8.2f}  p90 {d['p90']:8.2f}  "
                      f"p99 {d['p99']:8.2f}  max {d['max']:8.2f}")
    if "drain_loop" in r:
        loop = r["drain_loop"]
        tx, cw, iw = loop["transaction_ms"], loop["confirm_wait_ms"], loop["idle_wait_ms"]
        print(f"   drain loop: {loop['transactions']} transactions, {loop['empty_fetches']} "
              f"of {loop['fetches']} fetches empty, rows per non-empty fetch p50 "
              f"{loop['rows_per_nonempty_fetch']['p50']:.0f} max "
              f"{loop['rows_per_nonempty_fetch']['max']:.0f}")
        print(f"     transaction p50 {tx['p50']:.2f} ms p99 {tx['p99']:.2f} ms; confirm wait "
              f"p50 {cw['p50']:.2f} ms p99 {cw['p99']:.2f} ms; {loop['idle_waits']} idle "
              f"waits ({loop['idle_waits_ended_by_notify']} ended by a NOTIFY), idle p50 "
              f"{iw['p50']:.2f} ms")
        per_tx = max(loop["transactions"], 1)
        print("     statements per transaction (round trip p50/p99 ms): " + ", ".join(
            f"{name} {q['count'] / per_tx:.2f} ({q['p50']:.2f}/{q['p99']:.2f})"
            for name, q in loop["queries_ms"].items()))
        queued = loop["notifies_queued_at_idle"]
        if queued["max"] == queued["max"]:  # not NaN
            print(f"     NOTIFYs waiting at an idle wait: p50 {queued['p50']:.0f}, "
                  f"max {queued['max']:.0f}")
    print(f"   lost = {r['lost']} (not confirmed {r.get('not_confirmed', 'n/a')}, not "
          f"delivered {r.get('not_delivered', 'n/a')}; staged rows left at the end of the "
          f"run {left_staged}); duplicate deliveries {r.get('duplicates_delivered', 'n/a')}")


def summary_row(r: dict[str, Any]) -> dict[str, Any] | None:
    key = "commit_to_confirm_ms" if "commit_to_confirm_ms" in r else "commit_to_delivery_ms"
    d = r.get(key, {})
    if not d.get("count"):
        return None
    what = "confirm" if "confirm" in key else "consumer delivery"
    return {
        "target": f"latency @ {r['rate_offered']:g}/s (commit -> {what})",
        "goal": f"p50 <= {P50_GOAL_MS:g} ms, p99 <= {P99_GOAL_MS:g} ms, lost 0",
        "measured": (f"p50 {d['p50']:.1f} ms, p99 {d['p99']:.1f} ms, max {d['max']:.0f} ms "
                     f"({d['count']} jobs at {r['rate_achieved']:.0f}/s, lost {r['lost']}, "
                     f"machine {100 * (r['machine_cpu_busy_fraction'] or 0):.0f}% busy)"),
        "met": bool(verdict(d)) and r["lost"] == 0,
    }


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--drain-probe":
        return drain_probe(sys.argv[2:])

    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--rates", default=os.environ.get("BENCH_RATES", "1000,200,50"),
                        help="comma-separated jobs/s, run one after the other "
                        "(default 1000,200,50)")
    parser.add_argument("--duration", type=float,
                        default=float(os.environ.get("BENCH_DURATION", "20")),
                        help="measured seconds per rate, after the warm-up (default 20)")
    parser.add_argument("--warmup", type=float,
                        default=float(os.environ.get("BENCH_WARMUP", "2")),
                        help="seconds staged first and discarded (default 2)")
    parser.add_argument("--stagers", default="auto",
                        help="stager processes per rate; 'auto': one per 500 jobs/s")
    parser.add_argument("--plain", action="store_true",
                        help="run the unmodified `python -m drain run` (no commit -> confirm)")
    parser.add_argument("--no-consumer", action="store_true",
                        help="no consumer on the queue: messages pile up (disk path)")
    parser.add_argument("--drain-args", default="",
                        help="extra `drain run` flags, e.g. '--poll-interval 0.5'")
    parser.add_argument("--wait-quiet", type=float,
                        default=float(os.environ.get("BENCH_WAIT_QUIET", "0")),
                        help="before each rate, wait up to this many seconds for the machine "
                             f"to be under {100 * QUIET_BUSY:.0f}%% busy (default 0: no wait)")
    parser.add_argument("--keep-logs", action="store_true",
                        help="keep the drain's log and the probe's records (a temp directory)")
    parser.add_argument("--output", default=None,
                        help="default bench/results/latency.json (latency-smoke.json with "
                        "--smoke)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (checks the bench works; no figures)")
    args = parser.parse_args()
    if args.smoke:
        args.rates, args.duration, args.warmup, args.wait_quiet = "200", 2.0, 0.5, 0.0
    rates = [float(x) for x in args.rates.split(",") if x.strip()]
    name = "latency-smoke" if args.smoke else "latency"
    output = args.output or os.path.join(HERE, "results", f"{name}.json")

    outcome = run(args, rates)
    timelines = probe_timelines(outcome.probe) if outcome.probe is not None else None
    print(f"\nlatency: single-row staging transactions, {os.cpu_count()} cores, loopback "
          "Postgres and RabbitMQ, persistent messages, durable classic queue"
          + (", no consumer" if args.no_consumer else "")
          + (f", drain args {args.drain_args}" if args.drain_args else ""))
    results, summary = [], []
    for phase in outcome.phases:
        r = analyse(phase, outcome.delivered, timelines)
        if outcome.probe is not None:
            start = phase.schedule.t0 + phase.warmup
            r["drain_loop"] = probe_loop(outcome.probe, start, start + phase.duration)
        report(r, outcome.left_staged)
        row = summary_row(r)
        if row is not None:
            summary.append({**row, "met": None} if args.smoke else row)
        results.append(r)
    os.makedirs(os.path.dirname(output), exist_ok=True)
    with open(output, "w") as f:
        json.dump({
            "name": name,
            "summary": summary,
            "details": {
                "config": {"rates": rates, "duration": args.duration, "warmup": args.warmup,
                           "plain": args.plain, "consumer": not args.no_consumer,
                           "drain_args": args.drain_args,
                           "cores": os.cpu_count()},
                "rates": results,
                "left_staged_at_end": outcome.left_staged,
            },
        }, f, indent=2, default=str)
    print(f"\nwrote {output}")
    if args.smoke and len(summary) != len(outcome.phases):
        print("smoke: a rate measured no latency at all: the bench is broken", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
