"""A publish the broker refuses costs that message, never its batch (drain.broker.refusal).

``drain run --app tests.refused_app``: one task is routed through an exchange
that nobody declares, so the broker answers its publish with ``404 NOT_FOUND -
no exchange`` and closes the channel. Before, the drain took that for a lost
broker and published the whole batch again and again (every row before the
refused one ~8 times in 20 s, none deleted, no later row ever). Now the
refused row goes to dead_jobs (reason ``refused``, the broker's reply), the
other rows of its batch and of the batches in flight with it are delivered,
and later rows flow.
"""

from __future__ import annotations

import collections
import re
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import drain
from tests import refused_app, support


@pytest.fixture
def suffix() -> Iterator[str]:
    value = uuid.uuid4().hex[:10]
    yield value
    refused_app.delete_entities(value)


def _stage(db_url: str, tasks: list[str]) -> list[str]:
    """Stage ``tasks`` in one transaction, in this order: their task ids."""
    with psycopg.connect(db_url) as conn:
        return [str(drain.stage(conn, task, [i])) for i, task in enumerate(tasks)]


def test_a_refused_publish_costs_its_row_not_the_batch(
    db_url: str, suffix: str, spawn: Any
) -> None:
    port = support.free_port()
    env = support.drain_env(db_url, REFUSED_APP_SUFFIX=suffix, DRAIN_METRICS_PORT=str(port))
    # Batches of 5, 4 in flight: the refused publishes (rows 12 and 33) close the
    # channel under several batches at once.
    tasks = ["refused.ok"] * 40
    tasks[12] = tasks[33] = "refused.misrouted"
    ids = _stage(db_url, tasks)
    misrouted = {ids[12], ids[33]}
    proc = spawn(support.drain_argv("run", "--app", "tests.refused_app", "--poll-interval",
                                    "0.2", "--batch-size", "5"), env, "drain")
    support.wait_for(lambda: support.staged_count(db_url) == 0, 60,
                     "every row published or dead-lettered")
    later = _stage(db_url, ["refused.ok"] * 5)
    support.wait_for(lambda: support.staged_count(db_url) == 0, 30, "the later rows")

    queue = refused_app.names(suffix)["queue"]
    copies = collections.Counter(support.task_ids(support.drain_queue(queue)))
    good = [task_id for task_id in ids + later if task_id not in misrouted]
    assert set(copies) == set(good), "a row lost, or a refused one delivered"
    # Rows published after the refused one on its channel were dropped by the
    # broker and are published once; rows before it whose confirms the close cut
    # off are published again: twice at most, same task id.
    assert all(copies[task_id] == 1 for task_id in ids[34:] + later)
    assert max(copies.values()) <= 2

    with psycopg.connect(db_url) as conn:
        dead = conn.execute("SELECT task_id::text, reason, detail FROM dead_jobs").fetchall()
    assert {row[0] for row in dead} == misrouted
    missing = refused_app.names(suffix)["missing"]
    for _, reason, detail in dead:
        assert reason == "refused"
        assert detail.startswith(f"404 NOT_FOUND - no exchange '{missing}'"), detail
    listed = support.run_cli(db_url, "dead", "list", "--reason", "refused", env=env)
    assert listed.returncode == 0 and "refused.misrouted" in listed.stdout, listed

    _, metrics = support.http_get(port, "/metrics")
    assert re.search(r'^drain_publish_refused_total\{code="404"\} 2\.0$', metrics, re.M)
    assert re.search(r'^drain_dead_lettered_total\{reason="refused"\} 2\.0$', metrics, re.M)
    out = proc.output()
    assert "lost mid-batch" not in out and out.count("broker connected") == 1, out
    print(f"\n[refused] 43 unrelated rows delivered, copies {sorted(copies.values())}; "
          f"2 refused rows in dead_jobs")
