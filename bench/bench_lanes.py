"""Scale-out lanes: drain throughput with 1, 2 and 4 lanes, and where the CPU went.

    python bench/bench_lanes.py [--jobs 200000] [--lanes-list 1,2,4] [--batch-size 1000]
                                [--no-raw] [--no-spread] [--wait-quiet SECONDS] [--smoke]

Target 5: throughput for 1, 2 and 4 lanes; say where it stops scaling and why.

For each lane count N, one after the other: a fresh database and a fresh
durable queue (declared here, as Celery declares it; deleted after the round),
``--jobs`` rows staged with COPY (``drain.stage_many``) and ANALYZEd (not
timed), then N processes ``python -m drain run --exit-when-empty --lanes N
--lane K`` (K = 0..N-1) started at once. The round is timed from the first
start until the last exit, Python start-up included; rate = jobs / seconds.
Then: every drain exited 0, staged_jobs and dead_jobs are empty, and the queue
holds exactly ``--jobs`` messages.

Where the CPU went, from /proc, in % of one core (this machine's cores x 100 %
is the cap): the drains (exact, from ``wait4``'s rusage, per process), the
broker (``beam.smp``: utime+stime), Postgres (utime+stime of every postgres
process plus the postmaster's cutime+cstime, so backends that exit during the
round still count; "this database" sums the backends whose title names the
round's database, as last sampled), the whole machine from /proc/stat (busy
and idle, iowait counted as idle), and "other" = machine busy - drains -
broker - Postgres (other benches, this script, the kernel's softirqs not
charged to a process). The machine's load just before each round (a short
baseline) is reported too: other work on a shared machine skews the figures.
After each round (unless ``--no-raw``), the broker's own ceiling for as many
publishers: N processes publish the same number of messages with raw pika
(pipelined confirms, window 1000 each, the drain's encoded properties), first
into one queue, as the lanes do (every job names the same queue), then, for
N > 1, into N queues: whether the broker, or one queue in it, is the limit.
And for N > 1 (unless ``--no-spread``) one more drain round with the jobs
spread round-robin over N queues (each declared here): the lanes without the
one queue they all share in the target's round.

Samples every ``--interval`` seconds (CPU and the queue's message count) are
kept in the details as a timeline.

The broker holds one round's messages at a time (~3.7 KB of broker memory
each in a plain queue: ~0.75 GB for 200,000); its memory is checked first.
Prints a table and writes bench/results/lanes.json. Never run by the tests,
except ``--smoke``: 3,000 jobs, 1 and 2 lanes, every kind of round, which
checks that the bench works (the figures mean nothing) and writes
bench/results/lanes-smoke.json.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pika
import psycopg

import drain
from drain.broker.outgoing import Message
from drain.celery import message
from drain.postgres.rows import StagedRow
from drain.settings.urls import broker_parameters

sys.path.insert(0, os.path.dirname(__file__))
from bench_memory import BROKER_BYTES_PER_MESSAGE, broker_memory
from bench_throughput import raw_pika
from harness import (
    BROKER_URL,
    declare_queue,
    delete_queue,
    drop_database,
    fresh_database,
)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results" / "lanes.json"
SMOKE_RESULTS = RESULTS.with_name("lanes-smoke.json")
GOAL_JOBS = 200_000
CLK_TCK = os.sysconf("SC_CLK_TCK")
CORES = os.cpu_count() or 1
#: N drains on one host cannot share the metrics port: the bench turns it off (an env
#: variable, which a drain without metrics ignores).
DRAIN_ENV = {**os.environ, "DRAIN_METRICS_PORT": "0"}
#: Below this many % of one core idle (over all cores), the machine counts as saturated.
SATURATED_IDLE = 15.0
#: A baseline under this many % of one core busy counts as a quiet machine (--wait-quiet).
QUIET_BUSY = 20.0
#: A lane count that adds less than this to the rate of the one before has stopped scaling.
SCALING_GAIN = 1.10


# -- /proc ---------------------------------------------------------------------------------


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(utime+stime, cutime+cstime, ppid) of ``pid`` in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), int(fields[1])


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks over all cores since boot; iowait counts as idle."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal (guest is inside user already)
    idle = fields[3] + fields[4]
    return sum(fields) - idle, idle


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def postgres_processes() -> dict[int, str]:
    """Every process named postgres, with its title (``postgres: 15/main: user db ...``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and read_text(f"/proc/{entry}/comm").strip() == "postgres":
            found[int(entry)] = read_text(f"/proc/{entry}/cmdline").replace("\0", " ").strip()
    return found


def broker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split()]


@dataclasses.dataclass
class Snapshot:
    """Cumulative CPU clock ticks at one moment."""

    t: float
    busy: int
    idle: int
    broker: int
    postgres: int
    #: utime+stime of each live postgres process whose title names the round's database
    ours: dict[int, int]
    #: utime+stime of each live drain process
    drains: dict[int, int]


class Sampler:
    """Takes Snapshots of the machine, the broker, Postgres and the drain processes."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.broker = broker_pids()
        self.drain_pids: list[int] = []

    def take(self) -> Snapshot:
        t = time.perf_counter()
        busy, idle = machine_ticks()
        broker = 0
        for pid in self.broker:
            stat = proc_stat(pid)
            broker += stat[0] if stat else 0
        postgres = 0
        ours = {}
        processes = postgres_processes()
        for pid, title in processes.items():
            stat = proc_stat(pid)
            if stat is None:
                continue
            own, children, ppid = stat
            postgres += own
            if ppid not in processes:  # the postmaster: it reaps the backends that exit
                postgres += children
            if f" {self.database} " in f"{title} ":
                ours[pid] = own
        drains = {}
        for pid in self.drain_pids:
            stat = proc_stat(pid)
            if stat is not None:
                drains[pid] = stat[0]
        return Snapshot(t, busy, idle, broker, postgres, ours, drains)


def percent(ticks: float, seconds: float) -> float:
    """Clock ticks over ``seconds`` as % of one core."""
    return 100.0 * ticks / CLK_TCK / seconds if seconds > 0 else 0.0


def ours_ticks(snapshots: list[Snapshot]) -> int:
    """CPU of this database's backends over the snapshots: each pid's last value less its
    first (0 for a pid already there at the start; a pid that appeared counts from 0)."""
    first = snapshots[0].ours
    last: dict[int, int] = {}
    for s in snapshots:
        last.update(s.ours)
    return sum(v - first.get(pid, 0) for pid, v in last.items())


def interval_cpu(a: Snapshot, b: Snapshot) -> dict[str, float]:
    """CPU use between two snapshots, in % of one core."""
    seconds = b.t - a.t
    total = (b.busy - a.busy) + (b.idle - a.idle)
    # /proc/stat and the clock disagree a little: scale idle to the cores x 100 % cap.
    idle = 100.0 * CORES * (b.idle - a.idle) / total if total else 0.0
    drains = sum(v - a.drains.get(pid, 0) for pid, v in b.drains.items())
    return {
        "seconds": round(seconds, 3),
        "busy": round(100.0 * CORES - idle, 1),
        "idle": round(idle, 1),
        "drains": round(percent(drains, seconds), 1),
        "broker": round(percent(b.broker - a.broker, seconds), 1),
        "postgres": round(percent(b.postgres - a.postgres, seconds), 1),
    }


# -- one round -----------------------------------------------------------------------------


@dataclasses.dataclass
class Round:
    lanes: int
    jobs: int
    #: the jobs name this many queues, round-robin (1: all the same queue, as in the target)
    queues: int = 1
    stage_seconds: float = 0.0
    seconds: float = 0.0
    first_message_seconds: float | None = None
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    #: CPU seconds (user+system) of each drain process, from wait4's rusage
    drain_cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    drain_wall_seconds: list[float] = dataclasses.field(default_factory=list)
    queued: int = 0
    staged_left: int = -1
    dead: int = -1
    baseline: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    #: each drain's CPU % over the round
    per_drain: list[float] = dataclasses.field(default_factory=list)
    timeline: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: the broker's ceiling with N publishers: "one queue" and "N queues" -> figures
    raw: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def label(self) -> str:
        lanes = f"{self.lanes} lane{'s' if self.lanes > 1 else ''}"
        return lanes if self.queues == 1 else f"{lanes}, {self.queues} queues"

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        return (self.error is None and self.exit_codes == [0] * self.lanes
                and self.queued == self.jobs and self.staged_left == 0 and self.dead == 0)


class QueueCounter:
    """Messages in some queues, by passive declares on a connection of our own."""

    def __init__(self, queues: list[str]) -> None:
        self.queues = queues
        self._conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
        self._channel = self._conn.channel()

    def count(self) -> int:
        return sum(int(self._channel.queue_declare(q, passive=True).method.message_count)
                   for q in self.queues)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


def stage(url: str, n: int, queues: list[str]) -> float:
    t0 = time.perf_counter()
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"},
                          queue=queues[i % len(queues)])
                for i in range(n)
            ),
        )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("ANALYZE staged_jobs")
    return time.perf_counter() - t0


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM, then SIGKILL, the drains this bench started that still run (by pid)."""
    for p in procs:
        if p.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        if p.returncode is None:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def drain_round(rnd: Round, url: str, database: str, queues: list[str], *, batch_size: int,
                interval: float, timeout: float, baseline: float, wait_quiet: float,
                logdir: Path) -> None:
    """Run ``rnd.lanes`` drains at once and sample them until all exit."""
    sampler = Sampler(database)
    give_up = time.perf_counter() + wait_quiet
    while baseline > 0:
        a = sampler.take()
        time.sleep(baseline)
        rnd.baseline = interval_cpu(a, sampler.take())
        if rnd.baseline["busy"] < QUIET_BUSY or time.perf_counter() >= give_up:
            break
    counter = QueueCounter(queues)
    procs: list[subprocess.Popen[bytes]] = []
    logs = []
    started: dict[int, float] = {}
    running: dict[int, int] = {}  # pid -> index in procs
    snapshots: list[Snapshot] = []
    try:
        snapshots.append(sampler.take())
        t0 = time.perf_counter()
        for lane in range(rnd.lanes):
            log = open(logdir / f"lanes{rnd.lanes}-lane{lane}.log", "wb")  # noqa: SIM115
            logs.append(log)
            argv = [sys.executable, "-m", "drain", "run", "--exit-when-empty",
                    "--lanes", str(rnd.lanes), "--lane", str(lane),
                    "--database-url", url, "--broker-url", BROKER_URL,
                    "--batch-size", str(batch_size)]
            p = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, env=DRAIN_ENV)
            procs.append(p)
            started[p.pid] = time.perf_counter()
            running[p.pid] = lane
        sampler.drain_pids = list(running)
        rnd.exit_codes = [-1] * rnd.lanes
        rnd.drain_cpu_seconds = [0.0] * rnd.lanes
        rnd.drain_wall_seconds = [0.0] * rnd.lanes
        # The drains' CPU from wait4 replaces their /proc figures once they exit.
        exited_ticks: dict[int, int] = {}
        next_sample = time.perf_counter() + interval
        while running:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"the drains still ran after {timeout:.0f} s")
            for pid in list(running):
                got, wstatus, usage = os.wait4(pid, os.WNOHANG)
                if got == pid:
                    lane = running.pop(pid)
                    code = os.waitstatus_to_exitcode(wstatus)
                    procs[lane].returncode = code
                    rnd.exit_codes[lane] = code
                    used = usage.ru_utime + usage.ru_stime
                    rnd.drain_cpu_seconds[lane] = used
                    rnd.drain_wall_seconds[lane] = time.perf_counter() - started[pid]
                    exited_ticks[pid] = round(used * CLK_TCK)
            now = time.perf_counter()
            if now >= next_sample or not running:
                s = sampler.take()
                s.drains = {**s.drains, **exited_ticks}
                snapshots.append(s)
                try:
                    queued = counter.count()
                except Exception:  # the timeline only; the final count is checked below
                    queued = -1
                point = {"t": round(s.t - t0, 3), "queued": queued,
                         **interval_cpu(snapshots[-2], s)}
                rnd.timeline.append(point)
                if rnd.first_message_seconds is None and queued > 0:
                    rnd.first_message_seconds = point["t"]
                next_sample = now + interval
            time.sleep(0.01)
        rnd.seconds = snapshots[-1].t - t0
    finally:
        stop(procs)
        for log in logs:
            log.close()
        counter.close()

    first, last = snapshots[0], snapshots[-1]
    # The drains' CPU is exact (rusage); the machine's, broker's and Postgres' are from
    # the snapshots around the round (the first taken just before the first start).
    cpu = interval_cpu(first, last)
    seconds = last.t - first.t
    cpu["drains"] = round(100.0 * sum(rnd.drain_cpu_seconds) / seconds, 1)
    cpu["postgres_this_database"] = round(percent(ours_ticks(snapshots), seconds), 1)
    cpu["other"] = round(cpu["busy"] - cpu["drains"] - cpu["broker"] - cpu["postgres"], 1)
    rnd.cpu = cpu
    rnd.per_drain = [round(100.0 * c / seconds, 1) for c in rnd.drain_cpu_seconds]


def verify(rnd: Round, url: str, queues: list[str]) -> None:
    counter = QueueCounter(queues)
    try:
        rnd.queued = counter.count()
    finally:
        counter.close()
    with psycopg.connect(url) as conn:
        staged = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
        dead = conn.execute("SELECT count(*) FROM dead_jobs").fetchone()
    rnd.staged_left = int(staged[0]) if staged else -1
    rnd.dead = int(dead[0]) if dead else -1


def measure(rnd: Round, *, batch_size: int, interval: float, timeout: float,
            baseline: float, wait_quiet: float) -> None:
    """Fresh database and queue(s), stage, drain in lanes, verify; always clean up."""
    tag = uuid.uuid4().hex[:8]
    database = f"drain_bench_lanes_{tag}"
    queues = [f"bench_lanes_{tag}_{k}" for k in range(rnd.queues)]
    logdir = Path(tempfile.mkdtemp(prefix="bench_lanes_"))
    url = fresh_database(database)
    try:
        for q in queues:
            declare_queue(q)
        rnd.stage_seconds = stage(url, rnd.jobs, queues)
        print(f"{rnd.label}: staged {rnd.jobs:,} rows in {rnd.stage_seconds:.1f} s, "
              "draining", file=sys.stderr)
        try:
            drain_round(rnd, url, database, queues, batch_size=batch_size, interval=interval,
                        timeout=timeout, baseline=baseline, wait_quiet=wait_quiet,
                        logdir=logdir)
        except TimeoutError as exc:
            rnd.error = str(exc)
        verify(rnd, url, queues)
        if not rnd.ok:
            rnd.error = rnd.error or (
                f"exit codes {rnd.exit_codes}, {rnd.queued} queued of {rnd.jobs}, "
                f"{rnd.staged_left} left staged, {rnd.dead} dead")
            for log in sorted(logdir.glob("*.log")):
                print(f"--- {log.name} (end) ---\n"
                      f"{log.read_text(errors='replace')[-2000:]}", file=sys.stderr)
    finally:
        for q in queues:
            with contextlib.suppress(Exception):
                delete_queue(q)
        drop_database(database)
        shutil.rmtree(logdir, ignore_errors=True)


# -- the broker's ceiling: N raw publishers at once ------------------------------------------


def raw_messages(n: int, queue: str, first_id: int) -> list[Message]:
    """The messages the drain would build for ``n`` rows staged as this bench stages them."""
    origin = message.origin()
    return [
        message.build(
            StagedRow(i, uuid.uuid4(), "bench.index_annotation", json.dumps([i]),
                              json.dumps({"user": f"user{i % 97}"}), queue),
            origin=origin, reply_to=str(uuid.uuid4()))
        for i in range(first_id, first_id + n)
    ]


def raw_publisher(queue: str, n: int, first_id: int) -> int:
    """The child side of ``raw_round``: build, say ready, wait for go, publish, report."""
    messages = raw_messages(n, queue, first_id)
    print("ready", flush=True)
    sys.stdin.readline()
    elapsed = raw_pika(messages, pre_encoded=True)
    t1 = time.perf_counter()  # CLOCK_MONOTONIC: comparable across processes
    print(json.dumps({"t0": t1 - elapsed, "t1": t1}), flush=True)
    return 0


def wait_publishers(procs: list[subprocess.Popen[str]],
                    deadline: float) -> tuple[list[dict[str, float]], dict[int, int]]:
    """Wait for the raw publishers to exit: their reported spans, their CPU ticks."""
    spans, ticks = [], {}
    waiting = {p.pid: p for p in procs}
    while waiting:
        if time.perf_counter() > deadline:
            raise TimeoutError("the raw publishers ran past the timeout")
        for pid, p in list(waiting.items()):
            got, wstatus, usage = os.wait4(pid, os.WNOHANG)
            if got != pid:
                continue
            del waiting[pid]
            p.returncode = os.waitstatus_to_exitcode(wstatus)
            assert p.stdout is not None
            line = p.stdout.read()  # its one line, in the pipe already
            if p.returncode != 0 or not line.strip():
                raise RuntimeError(f"a raw publisher exited {p.returncode}")
            spans.append(json.loads(line))
            ticks[pid] = round((usage.ru_utime + usage.ru_stime) * CLK_TCK)
        time.sleep(0.01)
    return spans, ticks


def raw_round(rnd: Round, queues: list[str], timeout: float) -> dict[str, float]:
    """``rnd.lanes`` processes publish ``rnd.jobs`` messages in all, split evenly, each into
    ``queues[k % len(queues)]`` with raw pika (pipelined confirms, window 1000, the drain's
    encoded properties). The rate runs from the first publish to the last confirm; CPU
    from the go to the last exit."""
    n = rnd.lanes
    shares = [rnd.jobs // n + (1 if k < rnd.jobs % n else 0) for k in range(n)]
    procs: list[subprocess.Popen[str]] = []
    sampler = Sampler(database="-")
    try:
        for k in range(n):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--raw-publisher", queues[k % len(queues)],
                 str(shares[k]), str(1 + sum(shares[:k]))],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("a raw publisher failed to start")
        sampler.drain_pids = [p.pid for p in procs]
        first = sampler.take()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        spans, ticks = wait_publishers(procs, first.t + timeout)
        last = sampler.take()
        last.drains = ticks
    finally:
        for p in procs:
            if p.returncode is None:
                p.kill()
                p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
    seconds = max(x["t1"] for x in spans) - min(x["t0"] for x in spans)
    cpu = interval_cpu(first, last)
    return {"jobs_per_second": round(rnd.jobs / seconds), "seconds": round(seconds, 3),
            "publishers_cpu": cpu["drains"], "broker_cpu": cpu["broker"], "idle": cpu["idle"],
            "other": round(cpu["busy"] - cpu["drains"] - cpu["broker"], 1)}


def measure_raw(rnd: Round, timeout: float) -> None:
    """The broker's ceiling for this many publishers: into one queue (as the lanes publish:
    every job goes to the one queue its row names) and, for N > 1, into N queues."""
    variants = {"one queue": 1} if rnd.lanes == 1 else {"one queue": 1, "N queues": rnd.lanes}
    for name, count in variants.items():
        tag = uuid.uuid4().hex[:8]
        queues = [f"bench_lanes_raw_{tag}_{k}" for k in range(count)]
        try:
            for q in queues:
                declare_queue(q)
            rnd.raw[name] = raw_round(rnd, queues, timeout)
        except (RuntimeError, TimeoutError) as exc:
            print(f"raw x{rnd.lanes} ({name}) failed: {exc}", file=sys.stderr)
        finally:
            for q in queues:
                with contextlib.suppress(Exception):
                    delete_queue(q)


# -- report --------------------------------------------------------------------------------


def per_job_us(r: Round) -> dict[str, float]:
    """CPU microseconds per job, by component, over the round (start-up included)."""
    c, per = r.cpu, 1e6 * r.seconds / 100.0 / r.jobs  # % of one core -> us per job
    return {k: round(c[k] * per, 1) for k in ("drains", "broker", "postgres",
                                                "postgres_this_database", "other")}


def ceiling(r: Round) -> float:
    """The rate all cores would give if the drains, broker and Postgres had them to
    themselves at this round's CPU cost per job."""
    us = per_job_us(r)
    total = us["drains"] + us["broker"] + us["postgres"]
    return CORES * 1e6 / total if total else 0.0


def steady_rate(r: Round) -> float:
    """Jobs per second from the first message in the queue to the last drain's exit."""
    if r.first_message_seconds is None or r.seconds <= r.first_message_seconds:
        return 0.0
    return r.jobs / (r.seconds - r.first_message_seconds)


def broker_evidence(r: Round, spread: Round | None) -> tuple[str, bool]:
    """What the raw publishers and the spread round say at ``r``'s lane count, and whether
    they show the one queue as the ceiling: the drains reach >= 80 % of what N raw
    publishers get into one queue, and N queues take >= 25 % more."""
    one, many = r.raw.get("one queue"), r.raw.get("N queues")
    if one is None:
        return "", False
    text = f"raw pika x{r.lanes}: {one['jobs_per_second'] / 1000:.1f}k/s into one queue"
    wider = False
    if many:
        text += f", {many['jobs_per_second'] / 1000:.1f}k/s into {r.lanes}"
        wider = many["jobs_per_second"] >= 1.25 * one["jobs_per_second"]
    if spread is not None and spread.ok:
        text += f"; {r.lanes} lanes over {r.lanes} queues {spread.rate / 1000:.1f}k/s"
        wider = wider or spread.rate >= 1.25 * r.rate
    capped = wider and steady_rate(r) >= 0.8 * one["jobs_per_second"]
    return text, capped


def reason(rounds: list[Round]) -> tuple[str, str]:
    """Where the rate stops growing and what limits it there: a short line for the
    summary and a long one with the CPU split and the evidence."""
    cap = 100 * CORES
    done = [r for r in rounds if r.ok and r.queues == 1]
    if len(done) < 2:
        return ("too few complete rounds to say",) * 2
    stop_at = next((r for prev, r in itertools.pairwise(done)
                    if r.rate < SCALING_GAIN * prev.rate), None)
    r = stop_at or done[-1]
    c = r.cpu
    split = (f"drains {c['drains']:.0f} %, broker {c['broker']:.0f} %, "
             f"postgres {c['postgres']:.0f} %, other {c['other']:.0f} %, "
             f"idle {c['idle']:.0f} % of {cap} %")
    biggest = max(("the drains", c["drains"]), ("the broker", c["broker"]),
                  ("postgres", c["postgres"]), ("other load (not this bench)", c["other"]),
                  key=lambda kv: kv[1])[0]
    where = (f"stops scaling at {r.lanes} lanes" if stop_at
             else f"still scaling at {r.lanes} lanes")
    spread = next((x for x in rounds if x.lanes == r.lanes and x.queues > 1), None)
    evidence, capped = broker_evidence(r, spread)
    if c["idle"] < SATURATED_IDLE:
        why = f"CPU-bound: {CORES} cores saturated, {biggest} the largest share"
    elif capped:
        why = ("the one queue all lanes publish to is the ceiling (a classic queue is one "
               "Erlang process), with CPU to spare")
    else:
        why = "CPU left idle: waits (round trips, confirms, fsync), not cores"
    after = ""
    if spread is not None and spread.ok and spread.cpu["idle"] < SATURATED_IDLE:
        after = (f"; over {spread.queues} queues the cores saturate "
                 f"{'too' if c['idle'] < SATURATED_IDLE else 'instead'} "
                 f"(idle {spread.cpu['idle']:.0f} %)")
    busy_before = max((x.baseline.get("busy", 0.0) for x in done), default=0.0)
    other = max(x.cpu["other"] for x in done)
    noisy = max(busy_before, other) > QUIET_BUSY
    evidence = f"; {evidence}" if evidence else ""
    short = f"{where}: {why}{evidence}{after}{'; NOT a quiet machine' if noisy else ''}"
    noise = (f"; NOT a quiet machine: up to {busy_before:.0f} % busy before a round, "
             f"up to {other:.0f} % other load during one" if noisy else "")
    return short, f"{where}: {why} ({split}){evidence}{after}{noise}"


def base_rate(rounds: list[Round]) -> float | None:
    return next((r.rate for r in rounds if r.lanes == 1 and r.queues == 1 and r.ok), None)


def print_table(rounds: list[Round], jobs: int) -> None:
    base = base_rate(rounds)
    cap = 100 * CORES
    w = max(len("lanes"), *(len(r.label) for r in rounds))
    print(f"\nlanes: {jobs:,} jobs, {CORES} cores (CPU in % of one core, {cap} % in all), "
          "N `drain run --exit-when-empty --lanes N --lane K` started at once, timed to the "
          "last exit\n")
    print(f"| {'lanes':<{w}} | seconds | jobs/s | x 1 lane | drain CPU % (per lane) | "
          "broker CPU % | postgres CPU % (this db) | other % | idle % | ok |")
    print(f"|{'-' * (w + 2)}|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for r in rounds:
        c = r.cpu
        if not c:
            print(f"| {r.label:<{w}} | - | - | - | - | - | - | - | - | **no**: {r.error} |")
            continue
        x = f"{r.rate / base:.2f}" if base else "-"
        per = "+".join(f"{p:.0f}" for p in r.per_drain)
        print(f"| {r.label:<{w}} | {r.seconds:.2f} | {r.rate:,.0f} | {x} | "
              f"{c['drains']:.0f} ({per}) | {c['broker']:.0f} | "
              f"{c['postgres']:.0f} ({c['postgres_this_database']:.0f}) | {c['other']:.0f} | "
              f"{c['idle']:.0f} | {'yes' if r.ok else '**no**: ' + str(r.error)} |")
    print_notes(rounds)


def print_notes(rounds: list[Round]) -> None:
    """CPU per job, start-up, the raw publishers, the baselines."""
    measured = [r for r in rounds if r.cpu]
    if measured:
        print("\nCPU per job in us (start-up included), and the rate all cores would give the "
              "drains, broker and Postgres at that cost:")
    for r in measured:
        us = per_job_us(r)
        print(f"  {r.label}: drains {us['drains']:.0f}, broker {us['broker']:.0f}, "
              f"postgres {us['postgres']:.0f} (this db {us['postgres_this_database']:.0f}), "
              f"other {us['other']:.0f} -> ceiling {ceiling(r):,.0f} jobs/s")
    started = [r for r in rounds if r.first_message_seconds is not None and r.ok]
    if started:
        print("start-up (first message in a queue, to the interval) and the rate after it:")
    for r in started:
        print(f"  {r.label}: {r.first_message_seconds:.2f} s, then {steady_rate(r):,.0f} jobs/s")
    if any(r.raw for r in rounds):
        print("\nthe broker's ceiling: N raw pika publishers at once, each pipelining 1000 "
              "confirms with the drain's encoded properties, first publish to last confirm "
              "(CPU %: broker, idle, other):\n")
        print("| lanes | drain jobs/s after start-up | raw xN into one queue | "
              "raw xN into N queues |")
        print("|---:|---:|---|---|")
        for r in rounds:
            if r.queues != 1:
                continue
            cells = []
            for name in ("one queue", "N queues"):
                raw = r.raw.get(name)
                cells.append(f"{raw['jobs_per_second']:,.0f}/s ({raw['broker_cpu']:.0f}, "
                             f"{raw['idle']:.0f}, {raw['other']:.0f})" if raw else "-")
            print(f"| {r.lanes} | {steady_rate(r):,.0f} | {' | '.join(cells)} |")
    with_baseline = [r for r in rounds if r.baseline]
    if with_baseline:
        print("\nbefore each round (baseline: other load on the machine):")
    for r in with_baseline:
        b = r.baseline
        print(f"  {r.label}: machine busy {b['busy']:.0f} %, broker "
              f"{b['broker']:.0f} %, postgres {b['postgres']:.0f} % over {b['seconds']} s")


def write_results(rounds: list[Round], args: argparse.Namespace, short: str, why: str,
                  broker_before: dict[str, float] | None) -> None:
    base = base_rate(rounds)
    parts = []
    for r in rounds:
        if r.queues != 1:
            continue
        if not r.ok:
            parts.append(f"{r.lanes}: failed")
        elif r.lanes == 1 or base is None:
            parts.append(f"{r.lanes}: {r.rate:,.0f}/s")
        else:
            parts.append(f"{r.lanes}: {r.rate:,.0f}/s ({r.rate / base:.2f}x)")
    size = "" if args.jobs >= GOAL_JOBS else f" [{args.jobs:,} jobs, not the goal's {GOAL_JOBS:,}]"
    path = SMOKE_RESULTS if args.smoke else RESULTS
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "name": "lanes-smoke" if args.smoke else "lanes",
        "summary": [{
            "target": "5. Scale-out lanes",
            "goal": "throughput for 1, 2, 4 lanes; say where it stops scaling and why",
            "measured": f"{', '.join(parts)}; {short}{size}",
            "met": None,
        }],
        "details": {
            "reason": why,
            "jobs": args.jobs, "batch_size": args.batch_size, "cores": CORES,
            "cpu_unit": f"% of one core ({100 * CORES} % = all cores)",
            "interval": args.interval, "broker_memory_before": broker_before,
            "rounds": [{
                "lanes": r.lanes, "queues": r.queues, "ok": r.ok, "error": r.error,
                "seconds": round(r.seconds, 3), "jobs_per_second": round(r.rate),
                "x_1_lane": round(r.rate / base, 3) if base and r.ok else None,
                "first_message_seconds": r.first_message_seconds,
                "jobs_per_second_after_first_message": round(steady_rate(r)) if r.ok else None,
                "cpu_us_per_job": per_job_us(r) if r.cpu else None,
                "ceiling_jobs_per_second": round(ceiling(r)) if r.cpu else None,
                "stage_seconds": round(r.stage_seconds, 2),
                "exit_codes": r.exit_codes, "queued": r.queued,
                "staged_left": r.staged_left, "dead": r.dead,
                "drain_cpu_seconds": [round(c, 3) for c in r.drain_cpu_seconds],
                "drain_wall_seconds": [round(w, 3) for w in r.drain_wall_seconds],
                "cpu": {**r.cpu, "per_drain": r.per_drain},
                "raw_publishers": r.raw,
                "baseline": r.baseline, "timeline": r.timeline,
            } for r in rounds],
        },
    }, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", file=sys.stderr)


def lane_counts(text: str) -> list[int]:
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"expected lane counts like 1,2,4, got {text!r}")
    return counts


def main() -> int:
    if sys.argv[1:2] == ["--raw-publisher"]:
        return raw_publisher(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int,
                        default=int(os.environ.get("BENCH_JOBS", str(GOAL_JOBS))),
                        help=f"rows staged per round (env BENCH_JOBS, default {GOAL_JOBS:,})")
    parser.add_argument("--lanes-list", type=lane_counts, default=[1, 2, 4], metavar="N,N,...",
                        help="lane counts, one round each (default 1,2,4)")
    parser.add_argument("--batch-size", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.25,
                        help="seconds between CPU and queue samples (default 0.25)")
    parser.add_argument("--baseline", type=float, default=2.0,
                        help="seconds of machine load measured before each round (default 2)")
    parser.add_argument("--wait-quiet", type=float, default=0.0, metavar="SECONDS",
                        help=f"before each round, wait up to this long for a baseline with "
                        f"the machine under {QUIET_BUSY:g} %% busy (default 0: do not wait)")
    parser.add_argument("--no-raw", action="store_true",
                        help="skip the broker's ceiling: N raw pika publishers at once, into "
                        "one queue and into N queues, after each lane count")
    parser.add_argument("--no-spread", action="store_true",
                        help="skip the extra round per lane count N > 1 with the jobs spread "
                        "over N queues")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="give up on a round after this many seconds (default 900)")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (checks the bench works; no figures)")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.lanes_list, args.baseline, args.timeout = 3000, [1, 2], 0.2, 120.0

    broker_before = broker_memory()
    need_mb = args.jobs * BROKER_BYTES_PER_MESSAGE / 1e6
    if broker_before is None:
        print("rabbitmqctl unavailable: cannot check the broker's memory", file=sys.stderr)
    elif broker_before["watermark_mb"] - broker_before["used_mb"] < 2 * need_mb:
        print(f"broker memory is short: {broker_before['used_mb']:.0f} MB used of "
              f"{broker_before['watermark_mb']:.0f} MB, a round needs ~{need_mb:.0f} MB; "
              "use fewer --jobs", file=sys.stderr)
        return 1
    if not broker_pids():
        print("no beam.smp process visible: broker CPU will read 0", file=sys.stderr)

    rounds = []
    for lanes in args.lanes_list:
        spread = [] if args.no_spread or lanes == 1 else [lanes]
        for queues in [1, *spread]:
            rnd = Round(lanes=lanes, jobs=args.jobs, queues=queues)
            rounds.append(rnd)
            measure(rnd, batch_size=args.batch_size, interval=args.interval,
                    timeout=args.timeout, baseline=args.baseline, wait_quiet=args.wait_quiet)
            if not rnd.ok:
                print(f"{rnd.label} FAILED: {rnd.error}", file=sys.stderr)
                continue
            print(f"{rnd.label}: {rnd.rate:,.0f} jobs/s in {rnd.seconds:.2f} s", file=sys.stderr)
            if queues == 1 and not args.no_raw:
                measure_raw(rnd, args.timeout)

    print_table(rounds, args.jobs)
    short, why = reason(rounds)
    print(f"\n{why}")
    write_results(rounds, args, short, why, broker_before)
    return 0 if all(r.ok for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
