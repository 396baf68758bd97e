"""``drain_jobs.run_eagerly(app)``: the staged jobs run in the test, by the user's Celery app.

For tests without a broker. Each staged job runs as a worker would run its
message, in-process: ``Task.apply`` with the staged args and kwargs and the
staged task id, its ``link`` / ``link_error`` callbacks, and for a chain the
rest of the chain (Celery's ``chain.apply``). Its row is then deleted, on the
test's connection, in the test's transaction: this works inside a Django
``TestCase`` too, and sees the jobs staged there.

Order: as a drain would publish them. Each round reads the jobs staged now and
runs those due in the drain's order (highest priority first, then by staging
transaction, then by id), then, unless ``delayed=False``, those whose
countdown or eta is still ahead, by due time. Jobs the tasks stage meanwhile
run in the next round, as a drain would publish them in a later batch.
Expired jobs are not run (a drain moves them to dead_jobs); they stay staged.

For the length of the call the app runs with ``task_always_eager`` (and
``task_eager_propagates`` = ``propagate``), as Celery's own eager mode: the
callbacks, the rest of a chain, and the tasks a job sends with ``delay()`` run
in-process too, not through a broker. Not carried over: the ``drain_tag``
header (``self.request.drain_tag`` is missing in an eager run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
from collections.abc import Iterator
from typing import Any

from celery import Celery, chain

from drain.errors import FixtureError
from drain.testing import jobs

#: The most jobs one call runs before it stops: a task that stages itself for ever.
LIMIT = 1000
_DUE_NOW = dt.datetime.min.replace(tzinfo=dt.timezone.utc)


@dataclasses.dataclass(frozen=True)
class Ran:
    """A job run eagerly, and Celery's ``EagerResult`` (of a chain: its last task's)."""

    job: jobs.StagedJob
    result: Any


def run_eagerly(connection: Any, app: Celery, *, delayed: bool = True, propagate: bool = True,
                limit: int = LIMIT) -> list[Ran]:
    """Run every staged job with ``app`` (see the module's docstring); what ran, in order.

    ``propagate``: a task's exception is raised here, and its row stays staged;
    with False it is in the ``EagerResult`` and the row is deleted, as after a
    worker ran it.
    """
    ran: list[Ran] = []
    with _eager(app, propagate):
        while True:
            runnable = _in_drain_order(jobs.read(connection), delayed=delayed)
            if not runnable:
                return ran
            for job in runnable:
                if len(ran) >= limit:
                    raise FixtureError(
                        f"ran {limit} staged jobs and more are staged (a task that stages "
                        "itself?); pass a higher limit= if that is expected")
                ran.append(Ran(job, _signature(app, job).apply(throw=propagate)))
                jobs.delete(connection, [job.id])


def _in_drain_order(staged: list[jobs.StagedJob], *, delayed: bool) -> list[jobs.StagedJob]:
    def key(job: jobs.StagedJob) -> tuple[Any, ...]:
        return (not job.due, _DUE_NOW if job.due else job.eta, -job.priority, job.xact, job.id)

    return sorted((job for job in staged if not job.expired and (job.due or delayed)), key=key)


def _signature(app: Celery, job: jobs.StagedJob) -> Any:
    """What the worker would run for this job: its task with the staged id and
    callbacks, and the rest of its chain."""
    if job.task_name not in app.tasks:
        raise FixtureError(
            f"the Celery app {app.main!r} has no task {job.task_name!r} (`drain run --app` "
            f"would move the job to dead_jobs as unknown_task); it stays staged: "
            f"{job.describe()}")
    embed = job.embed or {}
    first = app.signature(job.task_name, args=job.args, kwargs=job.kwargs,
                          task_id=str(job.task_id))
    for option, key in (("link", "callbacks"), ("link_error", "errbacks")):
        if embed.get(key):
            first.set(**{option: [app.signature(s) for s in embed[key]]})
    rest = embed.get("chain") or []
    if not rest:
        return first
    # The embed keeps the rest of a chain last task first, as Celery's worker pops it.
    return chain(first, *(app.signature(s) for s in reversed(rest)), app=app)


@contextlib.contextmanager
def _eager(app: Celery, propagate: bool) -> Iterator[None]:
    before = (app.conf.task_always_eager, app.conf.task_eager_propagates)
    app.conf.task_always_eager, app.conf.task_eager_propagates = True, propagate
    try:
        yield
    finally:
        app.conf.task_always_eager, app.conf.task_eager_propagates = before
