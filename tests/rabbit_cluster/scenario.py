"""One fault run against the three-node cluster, and its Jepsen-style check.

A :class:`Scenario` stages a backlog, starts ``drain run --app`` (the quorum
app, tests/rabbit_cluster/quorum_app.py, whose broker list names the three
nodes), a real ``celery worker`` on the quorum queue, and an application that
keeps staging (:data:`STAGE_RATE` jobs/s, each in its own transaction). A test
injects its fault while the backlog drains; then the scenario waits until
every staged job has left ``staged_jobs``, brings every node back, starts a
new worker (how Celery's own consumer fares in a fault is not what is tested:
celery#9657), waits until every job ran, and checks:

* **lost**: every job staged (and committed) was consumed at least once. A
  row deleted without the cluster's confirm whose message was then lost shows
  here: its job never runs;
* **duplicates**: runs beyond the first, per job, counted;
* **resume**: seconds from the cluster's own recovery (a new leader, a node
  thawed or rejoined, given by the test) until the drain's
  ``drain_published_total`` grows again after a stall (no growth for
  :data:`STALL` seconds or more); 0 when the drain never stalled past the
  recovery. It is sampled every :data:`SAMPLE` seconds by a thread of the
  test from the drain's ``/metrics``.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
import sys
import threading
import time
from typing import Any

import pika
import psycopg

import drain
from tests import support
from tests.rabbit_cluster.cluster import Cluster, Node

#: The application's steady staging while the backlog drains (jobs/s).
STAGE_RATE = 25
#: The backlog staged before the drain starts; a fault hits once
#: :data:`FAULT_AT` of it is left (the drain publishes several thousand a second).
BACKLOG = 30_000
FAULT_AT = 25_000
#: A gap in the drain's progress this long (seconds) is a stall: at 25 jobs/s and a
#: NOTIFY per commit, the drain publishes every few tens of milliseconds.
STALL = 1.0
#: How often the drain's published count is sampled (seconds).
SAMPLE = 0.05
APP = "tests.rabbit_cluster.quorum_app"


@dataclasses.dataclass
class Outcome:
    staged: int
    lost: int
    duplicates: int
    resume: float
    longest_stall: float

    def line(self, fault: str) -> str:
        return (f"[cluster] {fault}: {self.staged} jobs, lost {self.lost}, "
                f"duplicates {self.duplicates}, publishing again {self.resume:.2f} s after "
                f"the cluster recovered (longest stall {self.longest_stall:.2f} s)")


class Scenario:
    def __init__(self, cluster: Cluster, db_url: str, queue: str, spawn: Any) -> None:
        self.cluster = cluster
        self.db_url = db_url
        self.queue = queue
        self.spawn = spawn
        self.metrics_port = support.free_port()
        self.env = support.drain_env(db_url, DRAIN_METRICS_PORT=str(self.metrics_port))
        del self.env["DRAIN_BROKER_URL"]  # the app's broker list
        self.env.update(
            DRAIN_CLUSTER_BROKERS=cluster.broker_list,
            DRAIN_CLUSTER_DATABASE=db_url,
            CLUSTER_QUEUE=queue,
            CLUSTER_CLASSIC_QUEUE=self.classic_queue,
        )
        self.staged: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        #: (monotonic time, drain_published_total) when it changed.
        self.progress: list[tuple[float, float]] = []
        self.drain: support.Process | None = None
        self.worker: support.Process | None = None
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE IF NOT EXISTS cluster_runs "
                         "(task_id text NOT NULL, i int NOT NULL, at timestamptz DEFAULT now())")

    # -- the parts ------------------------------------------------------------------

    def stage(self, n: int, task: str = "cluster.record") -> None:
        with psycopg.connect(self.db_url) as conn:
            ids = drain.stage_many(conn, (drain.Job(task, [i]) for i in range(n)))
        with self._lock:
            self.staged.extend(str(t) for t in ids)

    def start(self, backlog: int = BACKLOG, *, batch_size: int = 500) -> None:
        """The drain (connected to the first node: it is first in the list), the
        worker, the backlog and the steady staging."""
        self.stage(backlog)
        self.drain = self.spawn(
            support.drain_argv("run", "--app", APP, "--batch-size", str(batch_size),
                               "--poll-interval", "0.2"), self.env, "drain")
        self.drain.wait_for_output(
            f"connected to broker at amqp://guest:***@{self.cluster.nodes[0].address}", 60)
        self.start_worker()
        for target in (self._staging, self._sampling):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)
        support.wait_for(lambda: len(self.progress) > 1, 60, "the drain to publish")

    @property
    def classic_queue(self) -> str:
        return f"{self.queue}_classic"

    def start_worker(self) -> None:
        self.worker = self.spawn(
            [sys.executable, "-m", "celery", "-A", APP, "worker", "-Q",
             f"{self.queue},{self.classic_queue}",
             "-P", "threads", "-c", "8", "--without-gossip", "--without-mingle",
             "--without-heartbeat", "-l", "warning", "-n", f"{self.queue}@%h"],
            self.env, "worker")

    def _staging(self) -> None:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            i = 0
            next_at = time.monotonic()
            while not self._stop.is_set():
                with conn.transaction():
                    task_id = drain.stage(conn, "cluster.record", [i])
                with self._lock:
                    self.staged.append(str(task_id))
                i += 1
                next_at += 1 / STAGE_RATE
                self._stop.wait(max(next_at - time.monotonic(), 0))

    def _sampling(self) -> None:
        last = -1.0
        while not self._stop.is_set():
            value = self.metric("drain_published_total")
            if value is not None and value != last:
                self.progress.append((time.monotonic(), value))
                last = value
            self._stop.wait(SAMPLE)

    # -- what the cluster says ------------------------------------------------------

    def leader(self, via: Node | None = None) -> str:
        """The node that leads the quorum queue, as ``via`` (or the first live node)
        has it in its own metadata store: a local read, answered while another node
        is frozen or cut off. "" while none is known."""
        node = via or next(n for n in self.cluster.nodes if n.alive())
        expr = ('{ok, Q} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"/">>, queue, '
                f'<<"{self.queue}">>)), {{_, Leader}} = amqqueue:get_pid(Q), Leader.')
        try:
            out = self.cluster.ctl(node, "eval", expr, timeout=20)
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""
        return out.strip().strip("'")

    def backlog_left(self) -> int:
        return support.staged_count(self.db_url)

    def staged_of(self, task: str) -> int:
        with psycopg.connect(self.db_url) as conn:
            row = conn.execute("SELECT count(*) FROM staged_jobs WHERE task_name = %s",
                               [task]).fetchone()
        return int(row[0]) if row else 0

    def metric(self, name: str) -> float | None:
        """The sum of a counter's samples on the drain's /metrics (0 if it has none);
        None while the drain does not answer."""
        try:
            _status, body = support.http_get(self.metrics_port, "/metrics")
        except OSError:
            return None
        return sum(float(m.group(1)) for m in
                   re.finditer(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", body, re.M))

    def mid_backlog(self, at_most: int = FAULT_AT) -> None:
        """Until the drain has published some of the backlog and fewer than
        ``at_most`` staged rows are left to it (the fault hits mid-backlog)."""
        support.wait_for(lambda: self.backlog_left() < at_most, 120,
                         f"the backlog to fall under {at_most}", interval=0.01)

    def published_after(self, since: float, timeout: float = 120.0) -> float:
        """Until the drain published again after ``since``; the seconds it took."""
        support.wait_for(lambda: any(t > since for t, _ in self.progress), timeout,
                         "the drain to publish again")
        return min(t for t, _ in self.progress if t > since) - since

    def drain_log(self) -> str:
        return self.drain.output()[-5000:] if self.drain is not None else ""

    def report(self, fault: str, outcome: Outcome) -> None:
        """Print the fault's figures (make test-rabbit-cluster shows them)."""
        print("\n" + outcome.line(fault))

    # -- the end ----------------------------------------------------------------------

    def finish(self, fault_at: float, recovered_at: float,
               timeout: float = 240.0) -> Outcome:
        """Stop staging, wait until every job ran, and check (module docstring)."""
        support.wait_for(lambda: any(t >= recovered_at for t, _ in self.progress), 120,
                         "the drain to publish again after the cluster recovered")
        self._stop_threads()
        with self._lock:
            staged = list(self.staged)
        support.wait_for(lambda: self.backlog_left() == 0, timeout,
                         "every staged job to leave staged_jobs")
        # What the worker makes of the fault is Celery's (its failover with quorum
        # queues is celery#9657): the check is of the drain. So every node is
        # brought back, and a new worker consumes what the old one had not.
        self.cluster.restore()
        if self.worker is not None:
            self.worker.stop()
        self.start_worker()
        wanted = set(staged)
        # Until every job ran, or the deadline: then what never ran is counted lost.
        deadline = time.monotonic() + timeout
        while not wanted <= self.runs().keys() and time.monotonic() < deadline:
            time.sleep(0.1)
        runs = self.runs()
        # The stalls after the fault: gaps of STALL or more between two samples in
        # which the drain's count grew. Each counts from the cluster's recovery, or
        # from its start if it began later (a leader moving back, say).
        times = [fault_at, *(t for t, _ in self.progress if t > fault_at)]
        gaps = [(a, b) for a, b in itertools.pairwise(times) if b - a >= STALL]
        resume = max((b - max(a, recovered_at) for a, b in gaps if b > recovered_at),
                     default=0.0)
        return Outcome(staged=len(staged), lost=len(wanted - set(runs)),
                       duplicates=sum(runs.values()) - len(runs), resume=resume,
                       longest_stall=max((b - a for a, b in gaps), default=0.0))

    def runs(self) -> dict[str, int]:
        with psycopg.connect(self.db_url) as conn:
            rows = conn.execute("SELECT task_id, count(*) FROM cluster_runs "
                                "GROUP BY task_id").fetchall()
        return {str(r[0]): int(r[1]) for r in rows}

    def _stop_threads(self) -> None:
        """The application's staging and the sampling of the drain's count."""
        self._stop.set()
        for thread in self._threads:
            thread.join(10)

    def stop(self) -> None:
        self._stop_threads()
        for proc in (self.drain, self.worker):
            if proc is not None:
                proc.stop()


def delete_queues(cluster: Cluster, names: list[str]) -> None:
    """Delete the test's queues through any node that answers."""
    for node in cluster.nodes:
        if not node.alive():
            continue
        try:
            with node.channel() as channel:
                for name in names:
                    channel.queue_delete(name)
        except pika.exceptions.AMQPError:
            continue
        return

