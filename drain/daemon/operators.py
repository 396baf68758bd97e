"""What operators paused (drain.postgres.pauses), as the drain obeys it.

The pipeline reads ``drain_pauses`` in a batch's own snapshot whenever it may
have changed (its trigger notifies the drains; a new session reads it anyway)
and hands it to :meth:`OperatorPauses.apply`:

* a paused **queue** becomes a key of the holds that never runs out
  (``Holds.operate``, drain.daemon.holds): its rows are held as a refused
  queue's are (left out by name without ``--app``; with it, routed and held
  by route or id), but no declare or confirm resumes it, only the operator;
* a paused **task** is left out of the fetch and the look by name
  (``paused_tasks`` in drain/postgres/queries.sql), with ``--app`` or not.

Either way the marks may pass the paused rows (drain.postgres.keyset, "Paused
queues": a task counts among the skipped queues as :data:`TASK_SKIPPED` and its
name), and go back to fetch them the moment the pause is lifted.
"""

from __future__ import annotations

import logging

from drain.broker.outgoing import PauseKey
from drain.daemon.holds import Holds

log = logging.getLogger("drain.pipeline")

#: How the marks name a paused task among the queues they skipped: apart from
#: every queue name.
TASK_SKIPPED = "\x1ftask:"


class OperatorPauses:
    """The operators' pauses this drain obeys now."""

    def __init__(self, holds: Holds) -> None:
        self.holds = holds
        #: Paused tasks: name -> the reason given.
        self.tasks: dict[str, str] = {}

    def apply(self, pauses: list[tuple[str, str, str]]) -> None:
        """Obey ``pauses`` (every one, as ``(kind, name, reason)``) from now on."""
        self.holds.operate({PauseKey(name): reason for kind, name, reason in pauses
                            if kind == "queue"})
        tasks = {name: reason for kind, name, reason in pauses if kind == "task"}
        for name in sorted(tasks.keys() - self.tasks.keys()):
            log.warning("task %r: publishing paused by an operator (%s); its jobs stay "
                        "staged until `drain resume`", name, tasks[name])
        for name in sorted(self.tasks.keys() - tasks.keys()):
            log.warning("task %r: publishing resumed by an operator", name)
        self.tasks = tasks

    def task_names(self) -> list[str]:
        return sorted(self.tasks)

    def skipped(self) -> list[str]:
        """The paused tasks as the marks name them among the skipped queues."""
        return [TASK_SKIPPED + name for name in sorted(self.tasks)]
