"""Celery signatures as :func:`drain.stage` arguments.

A ``celery.canvas.Signature`` is a dict (``task``, ``args``, ``kwargs``,
``options``, ``subtask_type``), so this reads it without importing Celery.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from drain.errors import StagingError

#: Signature options with a meaning here, and drain.stage's name for each.
_SIGNATURE_OPTIONS = {"queue": "queue", "countdown": "countdown", "eta": "eta",
                      "expires": "expires", "priority": "priority", "task_id": "task_id"}


def from_signature(signature: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`stage`'s arguments for a Celery signature (a ``celery.canvas.Signature``
    is a dict: ``task``, ``args``, ``kwargs``, ``options``, ``subtask_type``).

    A plain task signature only: chains, groups and chords, and ``link`` /
    ``link_error`` callbacks, raise :class:`StagingError` saying what to do
    instead, as do options drain cannot honour (``routing_key``, ``exchange``:
    route with the app's ``task_routes`` and ``drain run --app``).
    """
    kind = signature.get("subtask_type")
    name = signature.get("task")
    if kind:
        raise StagingError(
            f"a {kind} cannot be staged yet: stage its first task, and let that task "
            f"start the rest ({kind}.apply_async in the task), or stage each task on its own"
        )
    options = dict(signature.get("options") or {})
    for callback in ("link", "link_error"):
        if options.pop(callback, None):
            raise StagingError(
                f"{name}: {callback} callbacks cannot be staged yet: call the callback "
                "from the task, or stage it from there"
            )
    unknown = sorted(set(options) - set(_SIGNATURE_OPTIONS))
    if unknown:
        raise StagingError(
            f"{name}: signature option(s) {unknown} cannot be staged (drain stages "
            f"{sorted(_SIGNATURE_OPTIONS)}; routing comes from `drain run --app`)"
        )
    staged = {_SIGNATURE_OPTIONS[key]: value for key, value in options.items()}
    if isinstance(staged.get("eta"), str):  # a signature that went through JSON
        staged["eta"] = _iso(name, "eta", staged["eta"])
    if isinstance(staged.get("expires"), str):
        staged["expires"] = _iso(name, "expires", staged["expires"])
    if staged.get("priority") is None:
        staged.pop("priority", None)
    return {"task_name": name, "args": signature.get("args") or (),
            "kwargs": signature.get("kwargs") or None, **staged}


def _iso(task_name: Any, what: str, text: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        raise StagingError(f"{what} for {task_name} is not an ISO date-time: {text!r}") from None
