"""The Celery application, configured for at-least-once processing.

* ``task_acks_late``: a message is acked after the task ran, not before, so a
  worker that dies mid-task leaves it in the queue for another worker.
* ``task_reject_on_worker_lost``: ... including when the worker process is
  killed outright (requeued rather than acked).
* ``worker_prefetch_multiplier = 1``: a worker holds at most one unacked
  message per process, so a crash redelivers at most that many.

With drain upstream, every copy of a job carries the same task id, so tasks
that must run effectively once can dedupe on ``self.request.id``.

``task_routes`` sends ``search.*`` tasks to the queue in
``CELERY_APP_SEARCH_QUEUE`` (default ``search``): ``drain run --app
celery_app`` routes a job staged without a queue the same way, as
``apply_async`` would (the demo does).

Run workers with the prefork or threads pool (the demo and the tests use
``-P threads -c 1``): under a steady stream of messages, Celery 5.7's solo
pool was seen leaving delivered messages unprocessed for ~10 s at a time.
"""

from __future__ import annotations

import os

from celery import Celery

BROKER_URL = os.environ.get("DRAIN_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672//")
SEARCH_QUEUE = os.environ.get("CELERY_APP_SEARCH_QUEUE", "search")

app = Celery("celery_app", broker=BROKER_URL, include=["celery_app.tasks"])
app.conf.update(
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue="celery",
    task_routes={"search.*": {"queue": SEARCH_QUEUE}},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
