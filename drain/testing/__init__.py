"""Testing code that stages jobs: the helpers behind drain's pytest fixtures.

drain.pytest_plugin gives a test ``staged_jobs`` (:class:`StagedJobs`: what
the code staged, read from the real ``staged_jobs`` table on the test's
connection) and ``drain_jobs`` (:class:`DrainJobs`: publish the staged jobs
through the real drain, or run them with the test's Celery app). docs/testing.md
shows them in a complete test.
"""

from __future__ import annotations

from typing import Any

from celery import Celery

from drain.errors import FixtureError
from drain.testing import connections, eager, publishing
from drain.testing.eager import Ran
from drain.testing.jobs import StagedJob, StagedJobs
from drain.testing.publishing import DeadJob, Published

__all__ = ["DeadJob", "DrainJobs", "FixtureError", "Published", "Ran", "StagedJob",
           "StagedJobs"]


class DrainJobs:
    """Empties ``staged_jobs`` in the test (the ``drain_jobs`` fixture): through the
    real drain and a real broker (:meth:`publish`), or with the test's Celery app
    and no broker (:meth:`run_eagerly`)."""

    def __init__(self, connection: Any, database_url: str | None = None,
                 broker_url: str | None = None) -> None:
        #: The test's connection (drain_connection): jobs are read on it.
        self.connection = connection
        self._database_url = database_url
        self._broker_url = broker_url

    @property
    def database_url(self) -> str:
        """The test database's URL: as given, or read off the test's connection."""
        return self._database_url or connections.database_url(self.connection)

    def publish(self, *, broker_url: str | None = None, app: str = "",
                **settings: Any) -> Published:
        """Publish every committed job that is due, as ``drain run --exit-when-empty``
        would, and wait for the broker's confirms.

        ``broker_url``: default the drain_broker_url fixture (or ini option), else
        the app's broker with ``app``, else ``amqp://guest:guest@127.0.0.1:5672//``.
        ``app``: the Celery app as ``drain run --app`` takes it (``"proj.celery:app"``),
        to route, declare and encode as its ``apply_async`` would. Any other
        :class:`drain.settings.config.Settings` field may be given (``queue_max_priority``,
        ``lock_key``...). Jobs not committed yet are refused (FixtureError).
        """
        if not isinstance(app, str):
            raise TypeError("give publish() the app as drain run --app takes it, "
                            f"'module:attribute', not {type(app).__name__}")
        return publishing.publish(self.connection, self.database_url,
                                  broker_url=broker_url or self._broker_url, celery_app=app,
                                  **settings)

    def run_eagerly(self, app: Celery, *, delayed: bool = True, propagate: bool = True,
                    limit: int = eager.LIMIT) -> list[Ran]:
        """Run every staged job with ``app``, in-process, in the order a drain would
        publish them, deleting each row it ran (drain.testing.eager); what ran.

        ``delayed=False`` leaves the jobs whose countdown or eta is ahead staged.
        ``propagate=False`` keeps a task's exception in its result instead of raising it.
        """
        return eager.run_eagerly(self.connection, app, delayed=delayed, propagate=propagate,
                                 limit=limit)
