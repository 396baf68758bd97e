"""The one harness every benchmark runs on; each bench_*.py is its scenario only.

* arguments: :func:`parser` (``--smoke`` and ``--rounds`` for every bench);
* set-up: :class:`Setup`, a run's database, queues and processes (the local
  Postgres, ``DRAIN_BENCH_ADMIN_URL``, and RabbitMQ, ``DRAIN_BROKER_URL``), all
  dropped, deleted or stopped afterwards; staged backlogs (:func:`stage`);
* processes: :func:`drain_process`, :func:`stop`, :func:`wait_until`;
* rounds: :func:`alternate` (variants take turns going first), :class:`Samples`
  (each variant's figures, and their medians), :func:`percentile`;
* CPU accounting: bench/cpu.py;
* the result: :func:`write_results`, bench/results/<name>.json (``<name>-smoke``
  under ``--smoke``, every row's ``met`` then None) and one summary line per row.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import pika
import psycopg

import drain
from drain.daemon.runner import Drain
from drain.postgres import migration
from drain.settings.config import Settings
from drain.settings.urls import broker_parameters

ADMIN_URL = os.environ.get("DRAIN_BENCH_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
T = TypeVar("T")
RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def fresh_database(name: str) -> str:
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute(f'CREATE DATABASE "{name}"')
    url = ADMIN_URL.rsplit("/", 1)[0] + f"/{name}"
    with psycopg.connect(url) as conn:
        migration.migrate(conn)
    return url


def drop_database(name: str) -> None:
    """Drop the database, and the group roles its migrate made (they outlive it)."""
    with psycopg.connect(ADMIN_URL, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        admin.execute("DROP ROLE IF EXISTS " + ", ".join(
            f'"{role}"' for role in migration.role_names(f"{name}_drain_")))


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


def declare_routed(queue: str) -> None:
    """``queue`` behind a durable direct exchange of the same name, bound by its
    name: what a Celery app declares for a queue named in ``task_routes``."""
    with broker_channel() as channel:
        channel.exchange_declare(queue, "direct", durable=True)
        channel.queue_declare(queue, durable=True)
        channel.queue_bind(queue, queue, routing_key=queue)


def delete_routed(queue: str) -> None:
    with broker_channel() as channel:
        channel.queue_delete(queue)
        channel.exchange_delete(queue)


def stage(url: str, n: int, queue: str | None, *, vacuum: bool = False) -> None:
    """``n`` jobs for ``queue`` (None: no queue given, for the app to route);
    ``vacuum``: then VACUUM the table, so that a round does not inherit the dead
    rows of the one before it (each round starts from the same table)."""
    with psycopg.connect(url) as conn:
        drain.stage_many(
            conn,
            (
                drain.Job("bench.index_annotation", [i], {"user": f"user{i % 97}"}, queue=queue)
                for i in range(n)
            ),
        )
    if vacuum:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("VACUUM (ANALYZE) staged_jobs")


def staged_count(url: str) -> int:
    """Rows in staged_jobs (the benches that wait for a drain to empty it)."""
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    return int(row[0]) if row else 0


def queue_depth(queue: str) -> int:
    with broker_channel() as channel:
        return int(channel.queue_declare(queue, passive=True).method.message_count)


class QueueCounter:
    """Messages in some queues, by passive declares on a connection of its own (for
    sampling a queue often, without a connection each time)."""

    def __init__(self, *queues: str) -> None:
        self.queues = queues
        self._conn = pika.BlockingConnection(broker_parameters(BROKER_URL))
        self._channel = self._conn.channel()

    def count(self) -> int:
        return sum(int(self._channel.queue_declare(q, passive=True).method.message_count)
                   for q in self.queues)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._conn.close()


# -- arguments ----------------------------------------------------------------------------

def parser(doc: str | None, *, rounds: int | None = None) -> argparse.ArgumentParser:
    """A bench's parser: its docstring's first paragraph, ``--smoke`` and, when it
    alternates rounds, ``--rounds`` (default ``rounds``)."""
    result = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    result.add_argument("--smoke", action="store_true",
                        help="a tiny run: checks the bench works (no figures)")
    if rounds is not None:
        result.add_argument("--rounds", type=int, default=rounds,
                            help=f"rounds of every variant (default {rounds})")
    return result


# -- set-up -------------------------------------------------------------------------------

class Setup(contextlib.ExitStack):
    """One run's database, queues and processes, named after ``prefix`` and a random
    tag; on exit the processes are stopped, the queues deleted, the database dropped."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.tag = uuid.uuid4().hex[:8]
        self.prefix = prefix
        self.database_url = ""

    def database(self, name: str = "") -> str:
        """A fresh migrated database (dropped at exit); its URL."""
        db = name or f"drain_bench_{self.prefix}_{self.tag}"
        self.database_url = fresh_database(db)
        self.callback(_quietly, drop_database, db)
        return self.database_url

    def queue(self, kind: str = "", *, declare: bool = True, routed: bool = False) -> str:
        """A durable queue's name (deleted at exit), declared unless ``declare`` is
        false; ``routed``: behind a direct exchange of its name (:func:`declare_routed`)."""
        name = f"bench_{self.prefix}{'_' + kind if kind else ''}_{self.tag}"
        self.callback(_quietly, delete_routed if routed else delete_queue, name)
        if routed and declare:
            declare_routed(name)
        elif declare:
            declare_queue(name)
        return name

    def process(self, proc: subprocess.Popen[Any]) -> subprocess.Popen[Any]:
        """``proc`` is stopped (TERM, then KILL) at exit."""
        self.callback(stop, [proc])
        return proc


def _quietly(cleanup: Callable[[str], None], name: str) -> None:
    with contextlib.suppress(Exception):
        cleanup(name)


@contextlib.contextmanager
def running(runner: Drain, *, join: float = 30.0) -> Iterator[threading.Thread]:
    """``runner.run()`` in a daemon thread, stopped and joined (up to ``join`` s) after."""
    thread = threading.Thread(target=runner.run, name="drain", daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        runner.stop()
        thread.join(join)


def seconds_to_confirm(settings: Settings, n: int, timeout: float, what: str) -> float:
    """A drain of ``settings`` in a thread of this process until it counts ``n`` rows
    confirmed (its own ``on_cycle``, as raw pika counts its confirms): the seconds
    from its start to that count. This thread sleeps on an event meanwhile: a poll
    every few milliseconds took the GIL from the drain's thread and counted as its
    time. SystemExit naming ``what`` if the drain stops or ``timeout`` passes."""
    reached = threading.Event()
    at: list[float] = []
    confirmed = 0

    def on_cycle(_answered: int, now_confirmed: int) -> None:
        nonlocal confirmed
        confirmed += now_confirmed
        if confirmed >= n and not at:
            at.append(time.perf_counter())
            reached.set()

    runner = Drain(settings, on_cycle=on_cycle)
    started = time.perf_counter()
    with running(runner) as thread:
        while not reached.wait(1.0):
            if not thread.is_alive():
                raise SystemExit(f"{what}: the drain stopped")
            if time.perf_counter() - started > timeout:
                raise SystemExit(f"{what}: {confirmed} of {n} confirmed in {timeout:g} s")
    return at[0] - started


# -- processes ----------------------------------------------------------------------------

def drain_process(*argv: str, env: dict[str, str] | None = None,
                  log: IO[Any] | int | None = subprocess.DEVNULL,
                  command: Sequence[str] = (), metrics: bool = True) -> subprocess.Popen[bytes]:
    """``python -m drain ARGV`` (or ``command`` + ARGV) from the repository's root,
    this tree first on PYTHONPATH; its output to ``log``. ``metrics=False``: no metrics
    port (a smoke run, which may run beside other benches' drains on the default one)."""
    base = dict(os.environ if env is None else env)
    if not metrics:
        base["DRAIN_METRICS_PORT"] = "0"
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH")) if p)
    return subprocess.Popen([*(command or (sys.executable, "-m", "drain")), *argv], env=base,
                            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                            stderr=subprocess.STDOUT)


def stop(procs: Sequence[subprocess.Popen[Any]], timeout: float = 30.0) -> None:
    """SIGTERM each that still runs, then SIGKILL any left after ``timeout``."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a drain's metrics server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def poll(condition: Callable[[], bool], timeout: float, *, interval: float = 0.1) -> bool:
    """Poll ``condition`` until it holds (True) or ``timeout`` seconds pass (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)
    return True


def wait_until(condition: Callable[[], bool], timeout: float, what: str, *,
               interval: float = 0.1) -> None:
    """:func:`poll`; SystemExit naming ``what`` after ``timeout``."""
    if not poll(condition, timeout, interval=interval):
        raise SystemExit(f"{what}: not within {timeout:g} s")


# -- rounds -------------------------------------------------------------------------------

def turns(round_: int, variants: Sequence[T]) -> list[T]:
    """``variants`` in round ``round_``'s order: reversed every other round, so that
    none always runs on a machine the one before it has just warmed or tired."""
    return list(variants if round_ % 2 == 0 else variants[::-1])


def alternate(rounds: int, variants: Sequence[str], run: Callable[[int, str], None]) -> None:
    """``run(round, variant)`` for every round and variant, in :func:`turns`."""
    for round_ in range(rounds):
        for variant in turns(round_, variants):
            run(round_, variant)


class Samples(dict[str, list[float]]):
    """Each variant's figures, one per round, in the order first added."""

    def add(self, variant: str, value: float) -> float:
        self.setdefault(variant, []).append(value)
        return value

    def medians(self) -> dict[str, float]:
        return {variant: statistics.median(values) for variant, values in self.items()}


def percentile(ordered: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of sorted values, interpolated between the
    closest ranks (numpy's default); NaN for none."""
    if not ordered:
        return math.nan
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


# -- the result ---------------------------------------------------------------------------

def row(target: str, goal: str, measured: str, met: bool | None) -> dict[str, Any]:
    """One summary row (bench/summary.py prints them as a table)."""
    return {"target": target, "goal": goal, "measured": measured, "met": met}


def write_results(name: str, summary: list[dict[str, Any]], details: dict[str, Any], *,
                  smoke: bool = False, path: Path | None = None) -> Path:
    """bench/results/<name>.json (``<name>-smoke.json``, every ``met`` None, under
    ``--smoke``); prints one summary line per row and where the file went."""
    if smoke:
        name, summary = f"{name}-smoke", [{**r, "met": None} for r in summary]
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"name": name, "summary": summary, "details": details},
                               indent=2, default=str) + "\n")
    print()
    for r in summary:
        verdict = {True: "met", False: "NOT MET", None: "-"}.get(r.get("met"), r.get("met"))
        print(f"{name}: {r['target']}: {r['measured']} [{verdict}]")
    print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return path
