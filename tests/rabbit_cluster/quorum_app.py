"""The Celery app of the cluster tests: quorum queues on the three nodes.

An ordinary app, as a user of a RabbitMQ cluster writes one: its ``broker_url``
lists the three nodes (``DRAIN_CLUSTER_BROKERS``, kombu's ``;`` failover
list), ``task_default_queue_type = "quorum"`` makes every queue it declares a
quorum queue, and ``broker_transport_options`` keeps ``confirm_publish`` on
(celery#9149). The worker records each run of :func:`record` in
``cluster_runs`` of ``DRAIN_CLUSTER_DATABASE``, one row per run, duplicates
included: the checker counts them (tests/rabbit_cluster/checker.py).

``CLUSTER_CLASSIC_QUEUE`` names a queue routed as a classic (non-replicated)
queue, declared on whichever node the drain is connected to.
"""

from __future__ import annotations

import os
from typing import Any

import psycopg
from celery import Celery
from kombu.entity import Queue

BROKERS = os.environ.get("DRAIN_CLUSTER_BROKERS", "amqp://guest:guest@127.0.0.2:5691//")
DATABASE = os.environ.get("DRAIN_CLUSTER_DATABASE", "")
QUEUE = os.environ.get("CLUSTER_QUEUE", "cluster_quorum")
CLASSIC = os.environ.get("CLUSTER_CLASSIC_QUEUE", "cluster_classic")

app = Celery("quorum_app", broker=BROKERS, set_as_current=False)
app.conf.update(
    task_default_queue=QUEUE,
    task_default_queue_type="quorum",
    task_queues=[
        Queue(QUEUE, queue_arguments={"x-queue-type": "quorum"}),
        Queue(CLASSIC),
    ],
    task_routes={"cluster.classic": {"queue": CLASSIC}},
    broker_transport_options={"confirm_publish": True},
    # A node that stops answering is noticed within seconds, by the worker and the drain.
    broker_heartbeat=5,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=4,
    worker_detect_quorum_queues=True,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

#: The worker's one connection (psycopg's is safe to share between its threads).
_conns: list[psycopg.Connection[Any]] = []


def _record(task_id: str, i: int) -> None:
    if not _conns or _conns[0].closed:
        _conns[:] = [psycopg.connect(DATABASE, autocommit=True)]
    _conns[0].execute("INSERT INTO cluster_runs (task_id, i) VALUES (%s, %s)", (task_id, i))


@app.task(name="cluster.record", bind=True)
def record(self: Any, i: int) -> None:
    _record(self.request.id, i)


@app.task(name="cluster.classic", bind=True)
def classic(self: Any, i: int) -> None:
    _record(self.request.id, i)
