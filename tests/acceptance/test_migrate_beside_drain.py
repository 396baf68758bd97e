"""``drain migrate`` again and again beside a drain running every statement it has
(issue 38: "test a migrate racing every statement the drain runs").

pgbench stages a mix that makes the drain run each of its statements on
staged_jobs and dead_jobs: ready jobs (fetch, delete), jobs whose expires_at
has passed (expiring, bury as 'expired'), rows no message can be made of (an
``expires_at`` of infinity: bury as 'invalid'), delayed jobs falling due
(the timed fetch), at several priorities. Meanwhile ``drain migrate`` runs
back to back, each taking staged_jobs and dead_jobs for a moment, as a
rolling deploy's migrate job does beside the running drain.

The drain is this release's, and the previous release's (tests/previous.py) on
this schema, as in a rolling deploy: its statements took the tables in another
order, and one of 10 rolling deploys deadlocked with its expiry.

Every migrate must succeed (a lock timeout or a deadlock is tried again:
drain.postgres.migration), the drain must never fail a statement or
reconnect over it, and every job must end up published once or
dead-lettered with its reason: nothing lost, nothing stuck.
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import psycopg
import pytest

from tests import skew, support

#: pgbench's transactions per second, in all, and for how long.
RATE = 50
SECONDS = 10
#: One transaction of the mix: a ready job, an expired one, an invalid one, a delayed
#: one (due within a second), each with a marker of its kind in kwargs.
MIX = """\
\\set p random(-1, 1)
BEGIN;
INSERT INTO staged_jobs (task_name, kwargs, queue, priority)
    VALUES ('celery_app.record', '{"kind": "ready"}', '{queue}', :p);
INSERT INTO staged_jobs (task_name, kwargs, queue, expires_at)
    VALUES ('celery_app.record', '{"kind": "expired"}', '{queue}', now() - interval '1 second');
INSERT INTO staged_jobs (task_name, kwargs, queue, expires_at)
    VALUES ('celery_app.record', '{"kind": "invalid"}', '{queue}', 'infinity');
INSERT INTO staged_jobs (task_name, kwargs, queue, not_before)
    VALUES ('celery_app.record', '{"kind": "delayed"}', '{queue}',
            now() + interval '300 milliseconds');
COMMIT;
"""


def _migrates(db_url: str, until: subprocess.Popen[str]) -> list[subprocess.CompletedProcess[str]]:
    """``drain migrate`` back to back until ``until`` has exited."""
    done: list[subprocess.CompletedProcess[str]] = []
    while until.poll() is None:
        done.append(support.run_cli(db_url, "migrate"))
    return done


@pytest.mark.parametrize("version", skew.VERSIONS)
def test_migrates_beside_a_busy_drain_all_succeed_and_lose_nothing(
    db_url: str, queue: str, spawn: Any, releases: skew.Releases, version: str,
) -> None:
    drain = spawn(releases.drain(version, "run", "--poll-interval", "0.2", "--batch-size", "50"),
                  support.drain_env(db_url), f"drain-{version}", cwd=releases.cwd)
    drain.wait_for_output("broker connected", timeout=30)
    script = releases.cwd / f"mix-{queue}.sql"
    script.write_text(MIX.replace("{queue}", queue))
    writers = subprocess.Popen(
        [support.pgbench(), "-n", "-c", "4", "-j", "2", "-R", str(RATE), "-T", str(SECONDS),
         "-f", str(script), db_url],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL,
    )
    try:
        migrates = _migrates(db_url, writers)
        out, _ = writers.communicate(timeout=60)
    finally:
        if writers.poll() is None:
            writers.kill()
            writers.wait(10)
    assert writers.returncode == 0, out
    failed = [m.stderr for m in migrates if m.returncode != 0]
    assert not failed, failed[0]
    assert len(migrates) >= 3, "the migrates did not overlap the load"

    try:
        support.wait_for(lambda: support.staged_count(db_url) == 0, 60, "the mix to drain")
    except AssertionError:
        with psycopg.connect(db_url) as conn:
            left = conn.execute("SELECT kwargs->>'kind', count(*) FROM staged_jobs "
                                "GROUP BY 1").fetchall()
        raise AssertionError(f"left staged: {left}\n{drain.output()[-3000:]}") from None
    with psycopg.connect(db_url) as conn:
        staged: dict[str, int] = dict(conn.execute(
            "SELECT reason, count(*) FROM dead_jobs GROUP BY reason").fetchall())
    messages = support.drain_queue(queue)
    kinds: dict[str, int] = {}
    for _, _, raw in messages:
        kind = json.loads(raw)[1]["kind"]
        kinds[kind] = kinds.get(kind, 0) + 1
    ids = support.task_ids(messages)
    retried = sum(m.stderr.count("trying again") for m in migrates)
    print(f"\n{len(migrates)} migrates beside the {version} drain ({retried} attempts tried "
          f"again), {len(ids)} published {kinds}, dead {staged}")
    assert len(set(ids)) == len(ids), "a job was published twice"
    assert kinds.get("ready", 0) == kinds.get("delayed", 0) > 0, kinds
    assert set(kinds) == {"ready", "delayed"}, kinds
    assert staged == {"expired": kinds["ready"], "invalid": kinds["ready"]}, staged
    assert "Traceback" not in drain.output()
    assert drain.output().count("database connected") == 1, drain.output()[-3000:]
