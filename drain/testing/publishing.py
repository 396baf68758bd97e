"""``drain_jobs.publish()``: the real drain, inside the test, until nothing due is left.

It is ``drain run --exit-when-empty`` in-process: a :class:`drain.daemon.runner.Drain`
with the settings given, on the test database, running in a thread while the
test waits. The drain opens its own sessions, so it publishes what is
committed, and nothing else: a job staged in a transaction still open (a
Django ``TestCase``) is refused here with the reason, rather than silently left
behind. Instead of retrying for ever as a service would, it gives up at the
first outage (a database or broker that does not answer, another drain holding
the lock) and says why.

What it leaves: rows not due yet stay staged (:attr:`Published.remaining`);
rows a drain moves aside (expired, too large, a task ``--app`` does not know)
are in dead_jobs (:attr:`Published.dead`); a due row still staged afterwards
(its queue refused by the broker, its messages returned) fails the call with
the drain's own warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator
from typing import Any

import psycopg

from drain.daemon.runner import Drain, State
from drain.errors import FixtureError
from drain.postgres import sql
from drain.settings.config import Settings
from drain.settings.urls import mask_database_url, scrub, secrets_of
from drain.testing import jobs

#: Seconds between two looks at the drain's state while the test waits for it.
LOOK = 0.02


@dataclasses.dataclass(frozen=True)
class DeadJob:
    """A job the drain moved to dead_jobs instead of publishing it."""

    task_name: str
    task_id: str
    #: expired, too_large, invalid, unknown_task or refused (staging_schema.sql).
    reason: str
    detail: str | None


@dataclasses.dataclass(frozen=True)
class Published:
    """What one ``drain_jobs.publish()`` did."""

    #: Messages the broker confirmed (their rows are gone).
    published: int
    #: Jobs moved to dead_jobs during the run, with the reason.
    dead: list[DeadJob]
    #: Jobs still staged: not due yet (a countdown or eta ahead).
    remaining: list[jobs.StagedJob]


def publish(connection: Any, database_url: str, **settings: Any) -> Published:
    """Run a drain with ``settings`` (:class:`drain.settings.config.Settings` fields) on
    ``database_url`` until nothing due is left; ``connection`` is the test's own,
    whose uncommitted jobs are refused."""
    config = Settings(database_url=database_url, **settings)
    try:
        own = psycopg.connect(database_url, autocommit=True)
    except psycopg.Error as exc:
        raise FixtureError(
            f"cannot connect to the test database {mask_database_url(database_url)}: "
            f"{scrub(str(exc), secrets_of(database_url)).strip()}") from None
    with own:
        _refuse_uncommitted(jobs.read(connection), jobs.read(own))
        mark = own.execute(sql.query("testing_dead_mark")).fetchone()
        published = _run(Drain(config, exit_when_empty=True))
        dead = [DeadJob(*row) for row in own.execute(sql.query("testing_dead_since"),
                                                     {"mark": mark[0] if mark else 0})]
        remaining = jobs.read(own)
    held = [job for job in remaining if job.due and not job.expired]
    if held:
        raise FixtureError(f"{len(held)} due job(s) stay staged after the drain ran (see the "
                           "drain's warnings in the captured log):\n" + _lines(held))
    return Published(published, dead, remaining)


def _refuse_uncommitted(seen: list[jobs.StagedJob], committed: list[jobs.StagedJob]) -> None:
    """Refuse what the test's open transaction staged (a drain would never see it)
    or deleted (a drain would publish it, then wait on its row lock)."""
    committed_ids, seen_ids = {job.id for job in committed}, {job.id for job in seen}
    uncommitted = [job for job in seen if job.id not in committed_ids]
    if uncommitted:
        raise FixtureError(
            f"{len(uncommitted)} staged job(s) are not committed, and a drain publishes only "
            "what is: commit first (a Django TestCase, or pytest-django's db fixture, keeps "
            "each test in one transaction: use TransactionTestCase or "
            "@pytest.mark.django_db(transaction=True)), or run them with "
            "drain_jobs.run_eagerly(app):\n" + _lines(uncommitted))
    deleted = [job for job in committed if job.id not in seen_ids]
    if deleted:
        raise FixtureError(
            f"{len(deleted)} committed job(s) are deleted in the test connection's open "
            "transaction (staged_jobs.clear()?), which holds their rows: commit or roll "
            "it back first:\n" + _lines(deleted))


def _lines(staged: list[jobs.StagedJob]) -> str:
    return "\n".join(f"  {job.describe()}" for job in staged[:jobs.SHOWN])


def _run(drain: Drain) -> int:
    """Run ``drain`` in a thread until it exits; stop it at its first outage."""
    failure: list[BaseException] = []

    def run() -> None:
        try:
            drain.run()
        except BaseException as exc:  # handed to the test's thread
            failure.append(exc)

    thread = threading.Thread(target=run, name="drain-publish", daemon=True)
    stuck: State | None = None
    with _warnings() as said:
        thread.start()
        try:
            while thread.is_alive() and stuck is None:
                thread.join(LOOK)
                if drain.state in (State.DB_DOWN, State.BROKER_DOWN, State.STANDBY):
                    stuck = drain.state
        finally:
            drain.stop()
            thread.join()
    if failure:
        raise failure[0]
    if stuck is State.STANDBY:
        raise FixtureError(
            f"another drain holds the drain lock on the test database (key "
            f"{drain.settings.lock_key}): stop it, or give publish() a lock_key of its own")
    if stuck is not None:
        what = "database" if stuck is State.DB_DOWN else "broker"
        raise FixtureError(f"the drain could not reach the {what}: "
                           + (said[-1] if said else "see the captured log"))
    return drain.published


@contextlib.contextmanager
def _warnings() -> Iterator[list[str]]:
    """The warnings drain logs meanwhile (passwords already masked there)."""
    said: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("drain")
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
