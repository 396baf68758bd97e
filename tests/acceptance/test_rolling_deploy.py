"""A rolling deploy under load, between the previous release and this one (issue 38).

An old leader drains while two applications stage about 100 jobs/s, one through
each release's library, each job its own transaction, as least-privileged
logins (the previous release's recipe: logins granted ``drain_stager`` and
``drain_runner``). The new release's ``drain migrate`` runs live beside the
old leader; a new drain starts as its standby; the old leader is stopped
(SIGTERM, or kill -9) and the new one takes over, while a real Celery worker
runs every job. The rollback runs the same steps the other way: a current
leader replaced by a previous-release standby on the current schema.

Checked: no application transaction failed, every committed job ran, every
row was deleted, and the duplicates stay within the documented bound (a leader
killed republishes at most ``--pipeline`` x ``--batch-size`` jobs,
docs/guarantees.md). The figures (jobs, duplicates, the takeover's gap) print
with ``-s``; docs/running.md, "Upgrading", reports them.
"""

from __future__ import annotations

import collections
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any, NamedTuple

import psycopg
import pytest

from tests import pg_server, skew, support
from tests.skew import CURRENT, PREVIOUS

#: Each application's rate (jobs/s): about 100 in all.
RATE = 50.0
#: The drains' batches: the bound on what a killed leader republishes is their product.
BATCH_SIZE = 100
PIPELINE = 2
#: Jobs run through each phase (old leader; after the migrate; new leader) before the next.
PER_PHASE = 300


class Deploy(NamedTuple):
    old: str
    new: str
    stop: signal.Signals

    def __str__(self) -> str:
        direction = "upgrade" if self.new == CURRENT else "rollback"
        return f"{direction}-{self.stop.name}"


DEPLOYS = [Deploy(PREVIOUS, CURRENT, signal.SIGTERM), Deploy(PREVIOUS, CURRENT, signal.SIGKILL),
           Deploy(CURRENT, PREVIOUS, signal.SIGKILL)]


class Logins(NamedTuple):
    admin: str
    app: str
    drain: str


@pytest.fixture
def logins(own_cluster: pg_server.Server, releases: skew.Releases) -> Iterator[Logins]:
    """A database the previous release migrated, with the logins its docs recipe
    grants: an application's (drain_stager) and the drain's (drain_runner)."""
    suffix = uuid.uuid4().hex[:8]
    app, runner = f"app_{suffix}", f"drain_{suffix}"
    with skew.database(own_cluster) as url:
        skew.migrate(releases, PREVIOUS, url)
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute(f"CREATE ROLE {app} LOGIN; GRANT drain_stager TO {app}; "
                          f"CREATE ROLE {runner} LOGIN; "
                          f"GRANT drain_runner, pg_read_all_stats TO {runner}")
        try:
            yield Logins(url, _as(url, app), _as(url, runner))
        finally:
            with psycopg.connect(own_cluster.url(), autocommit=True) as admin:
                admin.execute(f"DROP ROLE {app}, {runner}")


def _as(url: str, user: str) -> str:
    return url.replace("postgresql://postgres@", f"postgresql://{user}@", 1)


def _executed(url: str) -> collections.Counter[str]:
    return collections.Counter(r["task_id"] for r in support.executed(url))


def _more_run(url: str, than: int, what: str) -> None:
    support.wait_for(lambda: sum(_executed(url).values()) >= than + PER_PHASE, 120, what)


@pytest.mark.parametrize("deploy", DEPLOYS, ids=str)
def test_a_rolling_deploy_under_load_loses_nothing(
    releases: skew.Releases, logins: Logins, queue: str, spawn: Any, deploy: Deploy,
) -> None:
    if deploy.old == CURRENT:  # a rollback starts from the current schema
        skew.migrate(releases, CURRENT, logins.admin)
    drain_env = skew.env(logins.drain, CELERY_APP_DATABASE_URL=logins.admin)
    drain_args = ("run", "--poll-interval", "0.5", "--batch-size", str(BATCH_SIZE),
                  "--pipeline", str(PIPELINE))
    worker = spawn(support.celery_argv(queue), drain_env, "worker")
    old = spawn(releases.drain(deploy.old, *drain_args), drain_env, f"old-{deploy.old}",
                cwd=releases.cwd)
    worker.wait_for_output("ready.", timeout=60)
    old.wait_for_output("broker connected", timeout=30)

    stop = releases.cwd / f"stop-staging-{queue}"
    stagers = [spawn(skew.load_argv(releases, version, logins.app, queue, marker=version,
                                    rate=RATE, stop=stop), skew.env(logins.app),
                     f"app-{version}", cwd=releases.cwd)
               for version in skew.VERSIONS]
    _more_run(logins.admin, 0, "jobs to run through the old leader")

    # The new release's migrate (the rollback: the previous one's, as its deployment
    # runs it), live beside the leader and the applications.
    ran = sum(_executed(logins.admin).values())
    skew.migrate(releases, deploy.new, logins.admin)
    new = spawn(releases.drain(deploy.new, *drain_args), drain_env, f"new-{deploy.new}",
                cwd=releases.cwd)
    new.wait_for_output("standby:", timeout=30)
    _more_run(logins.admin, ran, "jobs to run after the live migrate")

    ran = sum(_executed(logins.admin).values())
    stopped = time.monotonic()
    old.kill(deploy.stop)
    old.wait(30)
    new.wait_for_output("broker connected", timeout=60)
    takeover = time.monotonic() - stopped
    _more_run(logins.admin, ran, "jobs to run through the new leader")

    stop.touch()
    for stager in stagers:
        assert stager.wait(60) == 0, stager.output()[-2000:]
    lines = [line for stager in stagers for line in stager.output().splitlines()]
    failed = [line for line in lines if line.startswith("failed:")]
    assert not failed, f"application transactions failed: {failed[:5]}"
    committed = {line for line in lines if len(line) == 36}
    assert len(committed) == len(lines)

    support.wait_for(lambda: committed <= set(_executed(logins.admin)), 120,
                     "every committed job to run")
    support.wait_for(lambda: support.staged_count(logins.admin) == 0, 30,
                     "every row to be deleted")
    counts = _executed(logins.admin)
    lost = committed - set(counts)
    duplicates = sum(counts.values()) - len(counts)
    print(f"\n[rolling deploy] {deploy}: {len(committed)} jobs committed, {len(lost)} lost, "
          f"{duplicates} duplicates, the new leader connected {takeover:.2f} s after "
          f"the old one's {deploy.stop.name}")
    assert not lost
    assert set(counts) == committed, "a job ran that nobody committed"
    ran_by = collections.Counter(r["args"][0] for r in support.executed(logins.admin))
    assert set(ran_by) == set(skew.VERSIONS), ran_by
    assert duplicates <= PIPELINE * BATCH_SIZE
    assert "Traceback" not in new.output(), new.output()[-3000:]
