"""``send_welcome.stage(conn, user_id)`` where Celery has ``send_welcome.delay(user_id)``.

:class:`StagingTask` is a Celery task class with two more methods:

* ``task.stage(conn, *args, **kwargs)``: as ``task.delay(*args, **kwargs)``,
  but staged on ``conn``, in the caller's transaction (:func:`drain.stage`);
* ``task.stage_with(conn, args, kwargs, **options)``: as ``task.apply_async``,
  with the options :func:`drain.stage` takes from a signature (``queue``,
  ``countdown``, ``eta``, ``expires``, ``priority``, ``task_id``, and ``link`` /
  ``link_error`` callbacks).

Both check the arguments against the task's function first, as Celery's
``apply_async`` does when the task's ``typing`` is on (the default): a call
the task could never take raises :class:`~drain.errors.StagingError` and
stages nothing. Use it for every task of an app::

    app = Celery("proj", task_cls="drain.celery_task:StagingTask")

or for one task: ``@app.task(base=StagingTask)``. Any task can also be staged
as a signature: ``drain.stage(conn, send_welcome.s(user_id).set(countdown=60))``.
"""

from __future__ import annotations

import inspect
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from celery import Task

from drain.errors import StagingError
from drain.staging import stage


class StagingTask(Task):  # type: ignore[misc]  # celery ships no type hints
    """A Celery task that can be staged: ``task.stage(conn, ...)``."""

    def stage(self, conn: Any, *args: Any, **kwargs: Any) -> uuid.UUID:
        """Stage ``task.delay(*args, **kwargs)`` on ``conn``; the Celery task id."""
        return self.stage_with(conn, args, kwargs)

    def stage_with(self, conn: Any, args: Sequence[Any] | None = None,
                   kwargs: Mapping[str, Any] | None = None, **options: Any) -> uuid.UUID:
        """Stage ``task.apply_async(args, kwargs, **options)`` on ``conn``; the task id."""
        self.check_call(args or (), kwargs or {})
        return stage(conn, self.signature(args, kwargs, **options))

    def check_call(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Raise StagingError when the task's function cannot take these arguments
        (only when the task's ``typing`` is on, as in Celery)."""
        if not self.typing:
            return
        try:
            inspect.signature(self.run).bind(*args, **kwargs)
        except TypeError as exc:
            raise StagingError(f"{self.name}: {exc}; nothing was staged") from None
