"""kill -9, SIGTERM and failover: nothing lost, duplicates keep their task id.

Every job staged here must end up in the queue at least once, and every copy
of a job must be the same message (same task id, same arguments).
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from typing import Any

import psycopg
import pytest

from tests import support


@pytest.mark.parametrize("setting", [(500, 2, 30_000), (200, 1, 20_000)],
                         ids=["batch500-pipeline2", "batch200-pipeline1"])
def test_kill_9_at_random_moments_loses_nothing(
    db_url: str, queue: str, spawn: Any, setting: tuple[int, int, int]
) -> None:
    """Nothing lost, and each kill republishes at most pipeline x batch size jobs:
    the batches published and not yet deleted by a committed transaction."""
    batch, pipeline, jobs = setting
    staged = support.stage_backlog(db_url, queue, jobs)
    env = support.drain_env(db_url)
    rng = random.Random()
    pause = threading.Event()  # never set: its wait() is an interruptible, bounded pause
    kills = 0
    for _ in range(8):
        before = support.staged_count(db_url)
        if before == 0:
            break
        proc = spawn(support.drain_argv("run", "--batch-size", str(batch),
                                        "--pipeline", str(pipeline)), env, "drain")
        proc.wait_for_output("broker connected", timeout=30)
        # Fault injection at a random moment of the drain's work, not synchronisation.
        pause.wait(rng.uniform(0.0, 0.4))  # 0.6 s let a fast drain finish in 2 kills
        proc.kill(signal.SIGKILL)
        proc.wait(10)
        kills += 1
    assert kills >= 3, "the backlog drained before enough kills happened; stage more"
    final = spawn(support.drain_argv("run"), env, "drain-final")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 120, "the backlog to drain")
    final.stop()
    copies = support.check_at_least_once(support.drain_queue(queue), staged)
    duplicates = sum(c - 1 for c in copies.values())
    print(f"{kills} kills, {len(staged)} jobs, {duplicates} duplicate deliveries "
          f"(batch {batch}, pipeline {pipeline}: at most {batch * pipeline} per kill)")
    assert duplicates <= kills * batch * pipeline


def test_sigterm_exits_promptly_and_cleanly(db_url: str, queue: str, spawn: Any) -> None:
    staged = support.stage_backlog(db_url, queue, 30_000)
    proc = spawn(support.drain_argv("run", "--batch-size", "200"), support.drain_env(db_url),
                 "drain")
    support.wait_for(lambda: support.staged_count(db_url) < len(staged), 60,
                     "the drain to make progress")
    sent = time.monotonic()
    proc.kill(signal.SIGTERM)
    assert proc.wait(30) == 0
    print(f"exited {time.monotonic() - sent:.2f}s after SIGTERM")
    assert "drain stopping" in proc.output()
    with psycopg.connect(db_url) as conn:
        remaining = {str(r[0]) for r in conn.execute("SELECT task_id FROM staged_jobs")}
    assert remaining, "the whole backlog drained before SIGTERM; stage more"
    messages = support.drain_queue(queue)
    published = {str(p.headers["id"]) for _, p, _ in messages}
    # Nothing half-done: every job is still staged or was published (or both).
    assert set(staged) == remaining | published
    # A clean stop settles its last batch: nothing both deleted-and-unpublished,
    # and nothing published-but-still-staged.
    assert not (remaining & published)


def test_standby_takes_over_when_the_active_drain_dies(
    db_url: str, queue: str, spawn: Any
) -> None:
    env = support.drain_env(db_url)
    first = spawn(support.drain_argv("run"), env, "first")
    first.wait_for_output("active: took the drain lock", timeout=30)
    second = spawn(support.drain_argv("run"), env, "second")
    second.wait_for_output("standby: another drain holds the lock", timeout=30)

    before = support.stage_backlog(db_url, queue, 200)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the first drain to publish")
    messages = support.drain_queue(queue)
    support.check_at_least_once(messages, before)
    origins = {p.headers["origin"].split("@")[0] for _, p, _ in messages}
    assert origins == {f"gen{first.pid}"}, "only the lock holder may publish"

    status = json.loads(
        support.run_cli(db_url, "status", "--json").stdout
    )
    assert status["lock"]["held"] and status["lock"]["pid"] == first.pid

    first.kill(signal.SIGKILL)
    killed_at = time.monotonic()
    after = support.stage_backlog(db_url, queue, 200)
    second.wait_for_output("active: took the drain lock", timeout=30)
    took_over = time.monotonic() - killed_at
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the second drain to publish")
    messages = support.drain_queue(queue)
    support.check_at_least_once(messages, after)
    assert {p.headers["origin"].split("@")[0] for _, p, _ in messages} == {f"gen{second.pid}"}
    print(f"standby took over {took_over:.2f}s after kill -9")
