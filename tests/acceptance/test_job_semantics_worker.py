"""Tags and expiry as a stock Celery worker sees them (real worker and drain processes)."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg

import drain
from drain.broker.amqp import EncodedProperties
from drain.celery import message
from drain.postgres.rows import StagedRow
from tests import support


def _executed_tags(db_url: str) -> dict[str, str | None]:
    """task id -> the drain tag the task read from its request, for every run task."""
    with psycopg.connect(db_url) as conn:
        exists = conn.execute("SELECT to_regclass('executed_jobs') IS NOT NULL").fetchone()
        if not exists or not exists[0]:
            return {}
        return dict(conn.execute("SELECT task_id::text, tag FROM executed_jobs").fetchall())


def _ran(db_url: str, *task_ids: str) -> bool:
    return set(task_ids) <= set(_executed_tags(db_url))


def test_the_task_reads_its_drain_tag_from_the_request(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    start_pipeline(db_url, queue)
    with psycopg.connect(db_url) as conn:
        tagged = str(drain.stage(conn, "celery_app.record", ["tagged"], queue=queue,
                                 tag="api.create_annotation"))
        untagged = str(drain.stage(conn, "celery_app.record", ["untagged"], queue=queue))
        row = conn.execute(
            "SELECT drain_stage('celery_app.record', args => '[\"sql\"]', queue => %s, "
            "tag => 'backfill.réindex')::text",
            (queue,),
        ).fetchone()
        assert row is not None
        by_sql = row[0]
    support.wait_for(lambda: _ran(db_url, tagged, untagged, by_sql), 60,
                     "the worker to run the three jobs")
    tags = _executed_tags(db_url)
    assert tags[tagged] == "api.create_annotation"
    assert tags[untagged] is None
    assert tags[by_sql] == "backfill.réindex"


def _publish(queue: str, expires_at: dt.datetime, args: list[Any]) -> str:
    """Publish what the drain builds for a row expiring at ``expires_at``; its task id.

    Built as if at a moment a minute before ``expires_at``, so the AMQP
    expiration property is a minute: RabbitMQ delivers the message, and only
    Celery's own check of the ``expires`` header can stop it.
    """
    row = StagedRow(id=0, task_id=uuid.uuid4(), task_name="celery_app.record",
                    args_json=support.dumps(args), kwargs_json="{}", queue=queue,
                    expires_at=expires_at)
    built = message.build(row, origin=message.origin(), reply_to=str(uuid.uuid4()),
                          now=expires_at.timestamp() - 60)
    assert built.properties["expiration"] == "60000"
    assert built.headers["expires"] == expires_at.isoformat()
    with support.broker_channel() as ch:
        ch.confirm_delivery()
        ch.basic_publish("", queue, built.body, EncodedProperties(built.encoded_properties),
                         mandatory=True)
    return built.task_id


def test_the_worker_does_not_run_a_job_whose_expiry_has_passed(
    db_url: str, queue: str, start_pipeline: Any
) -> None:
    _, worker = start_pipeline(db_url, queue)
    now = dt.datetime.now(dt.timezone.utc)
    expired = _publish(queue, now - dt.timedelta(seconds=5), ["expired"])
    # The same message with an expiry still ahead runs: the one above is
    # refused for its expiry, not for being malformed.
    live = _publish(queue, now + dt.timedelta(minutes=5), ["live"])
    # Staged after those were published: the single worker thread (prefetch 1) takes the
    # queue in order, so once this ran, the expired job had its chance.
    with psycopg.connect(db_url) as conn:
        sentinel = str(drain.stage(conn, "celery_app.record", ["sentinel"], queue=queue))
    support.wait_for(lambda: _ran(db_url, sentinel, live), 60,
                     "the worker to run the live and sentinel jobs")
    assert expired not in _executed_tags(db_url), "the worker ran an expired job"
    assert f"Discarding revoked task: celery_app.record[{expired}]" in worker.output()
