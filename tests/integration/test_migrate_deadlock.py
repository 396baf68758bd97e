"""``drain migrate`` deadlocked with a running drain tries again (issue 38).

In a rolling deploy, the new version's ``drain migrate`` runs beside the old
version's drain. One of 10 such runs deadlocked: the migrate held staged_jobs
and waited for dead_jobs, while the old drain's statement held dead_jobs and
waited for staged_jobs. Postgres ended the migrate, and ``drain migrate`` failed,
because it retried only a lock timeout. Here a session of the test holds
dead_jobs as such a statement does (ROW EXCLUSIVE, what an INSERT takes), waits
until the migrate queues for it, then reads staged_jobs: a real deadlock, which
only the migrate's session detects (the test's session waits 60 s before it
looks). The migrate must roll back, let the other session go on, and succeed on
its next attempt.
"""

from __future__ import annotations

import logging
import threading

import psycopg
import pytest

from drain.postgres.migration import migrate
from tests import support


def _waits_for_dead_jobs(db_url: str, pid: int) -> bool:
    """Whether session ``pid`` waits for a lock on dead_jobs."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted "
            "AND relation = 'dead_jobs'::regclass", [pid]).fetchone()
    return row == (1,)


def test_a_migrate_deadlocked_with_a_drain_statement_tries_again(
        db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    outcome: list[BaseException | str] = []
    migrating = psycopg.connect(db_url)
    pid = migrating.info.backend_pid

    def run() -> None:
        try:
            outcome.append(migrate(migrating, lock_timeout=30.0, attempts=5))
        except BaseException as exc:  # reported below
            outcome.append(exc)

    with psycopg.connect(db_url) as drain_like, caplog.at_level(logging.INFO, "drain.store"):
        # Only the migrate's session looks for the deadlock (after its 1 s default).
        drain_like.execute("SET deadlock_timeout = '60s'")
        drain_like.execute("LOCK TABLE dead_jobs IN ROW EXCLUSIVE MODE")
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        support.wait_for(lambda: _waits_for_dead_jobs(db_url, pid), 30,
                         "the migrate to hold staged_jobs and wait for dead_jobs")
        # Waits for the migrate's lock on staged_jobs: the deadlock. Answered once
        # Postgres has ended the migrate's attempt.
        drain_like.execute("SELECT count(*) FROM staged_jobs").fetchone()
        drain_like.commit()
        thread.join(60)
    migrating.close()
    assert not thread.is_alive(), "the migrate did not end"
    assert len(outcome) == 1 and isinstance(outcome[0], str), outcome
    assert "deadlocked with another session's statement" in caplog.text, caplog.text
