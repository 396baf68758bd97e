"""Chaos soak: a steady producer, a real Celery worker, and a fault injector.

    make soak                   # SOAK_SECONDS=180 by default
    SOAK_SECONDS=600 make soak

For SOAK_SECONDS, producers stage jobs at SOAK_RATE per second (default 100)
in small transactions, a share of them rolled back (SOAK_ROLLBACK, default
0.1); a real ``celery worker`` consumes them and records every execution in
Postgres. Two drains reach Postgres and RabbitMQ through TCP proxies: one
active, one standby. Every few seconds the fault injector
picks a fault at random: kill -9 the drain holding the lock, SIGTERM it, cut
the drains' database or broker connections, stall the broker for a
few seconds, hang the drains' database connections for 2-12 s (past the
drains' 2 s statement timeout + 5 s, they give them up), or raise a real
RabbitMQ memory alarm for 2-8 s (SOAK_FAULTS, a comma-separated subset,
chooses among them).
Killed drains are restarted.

At the end it waits for the backlog to drain and checks that every committed
job ran at least once and no rolled-back job ran, then prints a table. Exits 1
if a job was lost or a rolled-back job ran. Not part of ``make test``.
"""

from __future__ import annotations

import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import psycopg

import drain
from drain.postgres import migration
from drain.postgres import status as drain_status
from drain.settings.config import Settings
from tests import broker_alarm, support

FAULTS = ["kill -9", "sigterm", "cut database", "cut broker", "stall broker", "hang database",
          "broker alarm"]


class Soak:
    def __init__(
        self, seconds: float, rate: float, rollback: float, kinds: list[str] | None = None
    ) -> None:
        self.seconds, self.rate, self.rollback = seconds, rate, rollback
        self.kinds = FAULTS if kinds is None else kinds
        self.name = support.unique("drain_soak")
        self.queue = self.name
        self.url = support.database_url(self.name)
        self.logs = Path(tempfile.mkdtemp(prefix="drain-soak-"))
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self.faults: collections.Counter[str] = collections.Counter()
        self.stop = threading.Event()
        self.procs: list[support.Process] = []
        self.pg_proxy = support.TcpProxy(support.PG_PORT)
        self.amqp_proxy = support.TcpProxy(support.BROKER_PORT)
        self.drains: list[support.Process] = []
        self.started = 0

    # -- set-up ---------------------------------------------------------------------

    def setup(self) -> None:
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'CREATE DATABASE "{self.name}"')
        with psycopg.connect(self.url) as conn:
            migration.migrate(conn)
        self.pg_proxy.start()
        self.amqp_proxy.start()
        worker = self.spawn(support.celery_argv(self.queue), "worker", support.drain_env(self.url))
        worker.wait_for_output("ready.", timeout=60)
        self.drains = [self.start_drain(), self.start_drain()]

    def spawn(self, argv: list[str], name: str, env: dict[str, str]) -> support.Process:
        self.started += 1
        proc = support.Process(argv, env, self.logs / f"{name}-{self.started}.log")
        self.procs.append(proc)
        return proc

    def start_drain(self) -> support.Process:
        proxied = support.database_url(self.name).replace(
            f"127.0.0.1:{support.PG_PORT}", f"127.0.0.1:{self.pg_proxy.port}")
        env = support.drain_env(
            proxied, DRAIN_BROKER_URL=support.broker_url(self.amqp_proxy.port),
            CELERY_APP_DATABASE_URL=self.url,
        )
        return self.spawn(
            support.drain_argv("run", "--poll-interval", "0.5", "--confirm-timeout", "5",
                               "--db-timeout", "2"),
            "drain", env)

    def lock_holder(self) -> int | None:
        """Which of the drains holds the lock now (its index), if any."""
        with psycopg.connect(self.url) as conn:
            status = drain_status.read(conn, Settings().lock_key)
        pid = status["lock"].get("pid")
        return next((i for i, p in enumerate(self.drains) if p.pid == pid), None)

    def teardown(self) -> None:
        broker_alarm.clear_alarm()  # whatever the injector was doing when it stopped
        for proc in self.procs:
            proc.kill(signal.SIGKILL)
            proc.wait(10)
        self.pg_proxy.stop()
        self.amqp_proxy.stop()
        support.delete_queue(self.queue)
        with psycopg.connect(support.ADMIN_URL, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')

    # -- load and faults ---------------------------------------------------------------

    def produce(self) -> None:
        rng = random.Random(1)
        interval = 1.0 / self.rate
        with psycopg.connect(self.url) as conn:
            next_at = time.monotonic()
            while not self.stop.is_set():
                task_id = str(drain.stage(conn, "celery_app.record", [len(self.committed)],
                                          queue=self.queue, tag="soak"))
                if rng.random() < self.rollback:
                    conn.rollback()
                    self.rolled_back.add(task_id)
                else:
                    conn.commit()
                    self.committed.add(task_id)
                next_at += interval
                self.stop.wait(max(0.0, next_at - time.monotonic()))

    def inject(self) -> None:
        rng = random.Random()
        kinds = [k for k in FAULTS if k in self.kinds]
        while kinds and not self.stop.wait(rng.uniform(2.0, 6.0)):
            kind = rng.choice(kinds)
            self.faults[kind] += 1
            active = self.lock_holder() if kind in ("kill -9", "sigterm") else None
            if active is not None:
                victim = self.drains[active]
                victim.kill(signal.SIGKILL if kind == "kill -9" else signal.SIGTERM)
                victim.wait(30)
                self.drains[active] = self.start_drain()
            elif kind in ("kill -9", "sigterm"):
                self.faults[kind] -= 1  # nobody held the lock at that instant: no fault
                self.faults["(no lock holder to hit)"] += 1
            elif kind == "cut database":
                self.pg_proxy.cut()
            elif kind == "cut broker":
                self.amqp_proxy.cut()
            elif kind == "hang database":
                self.pg_proxy.stall(new_connections=False)
                self.stop.wait(rng.uniform(2.0, 12.0))
                self.pg_proxy.resume()
            elif kind == "broker alarm":
                with broker_alarm.memory_alarm():
                    self.stop.wait(rng.uniform(2.0, 8.0))
            else:
                self.amqp_proxy.stall()
                self.stop.wait(rng.uniform(2.0, 8.0))
                self.amqp_proxy.resume()

    # -- the run -------------------------------------------------------------------------

    def run(self) -> int:
        self.setup()
        try:
            threads = [threading.Thread(target=self.produce), threading.Thread(target=self.inject)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            self.stop.wait(self.seconds)
            self.stop.set()
            for t in threads:
                t.join()
            produced_for = time.monotonic() - t0
            self.amqp_proxy.resume()
            support.wait_for(lambda: support.staged_count(self.url) == 0, 300,
                             "the backlog to drain")
            support.wait_for(self._all_ran, 300, "the worker to run every committed job")
            drained_in = time.monotonic() - t0
            return self.report(produced_for, drained_in)
        finally:
            self.teardown()

    def _all_ran(self) -> bool:
        ran = {r["task_id"] for r in support.executed(self.url)}
        return self.committed <= ran

    def report(self, produced_for: float, drained_in: float) -> int:
        executions = collections.Counter(r["task_id"] for r in support.executed(self.url))
        lost = self.committed - set(executions)
        ghosts = self.rolled_back & set(executions)
        duplicates = sum(n - 1 for task_id, n in executions.items() if task_id in self.committed)
        total = len(self.committed)
        print(f"\nchaos soak: {produced_for:.0f} s of load at {self.rate:g} jobs/s "
              f"({self.rollback:.0%} rolled back), logs in {self.logs}\n")
        print("| measure | value |\n|---|---|")
        print(f"| jobs committed | {total} |")
        print(f"| jobs rolled back | {len(self.rolled_back)} |")
        for kind, n in sorted(self.faults.items()):
            print(f"| faults: {kind} | {n} |")
        print(f"| faults in all | {sum(self.faults.values())} |")
        print(f"| jobs lost | {len(lost)} |")
        print(f"| rolled-back jobs executed | {len(ghosts)} |")
        print(f"| duplicate executions | {duplicates} ({duplicates / max(total, 1):.2%}) |")
        print(f"| throughput held | {total / drained_in:.0f} jobs/s executed over "
              f"{drained_in:.0f} s, for {total / produced_for:.0f} jobs/s committed |")
        return 0 if not lost and not ghosts else 1


def main() -> int:
    seconds = float(os.environ.get("SOAK_SECONDS", "180"))
    rate = float(os.environ.get("SOAK_RATE", "100"))
    rollback = float(os.environ.get("SOAK_ROLLBACK", "0.1"))
    kinds = os.environ.get("SOAK_FAULTS")
    return Soak(seconds, rate, rollback,
                None if kinds is None else [k for k in kinds.split(",") if k]).run()


if __name__ == "__main__":
    sys.exit(main())
