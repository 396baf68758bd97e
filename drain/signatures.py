"""Celery signatures and chains as :func:`drain.stage` arguments.

A ``celery.canvas.Signature`` is a dict (``task``, ``args``, ``kwargs``,
``options``, ``subtask_type``), so a plain one is read without importing
Celery. What ``apply_async`` would put in the message besides the task and
its arguments, Celery's *embed* (the body's third part), is staged with the
row (``staged_jobs.embed``) and sent as it is:

* ``callbacks``: the signature's ``link`` option, the tasks a worker applies
  with the result once the task succeeded;
* ``errbacks``: its ``link_error`` option, applied when the task failed;
* ``chain``: for a chain, the tasks after the first, last one first, each
  with its task id: the worker applies the next one with the result.

A chain is prepared by Celery's own ``prepare_steps``, as ``chain.apply_async``
prepares it: nested chains are unrolled, every task gets its task id, the
chain's ``link_error`` goes to each task and its ``link`` to the last one.
Only its first task is staged; the worker that runs it sends the next one
(routed by that worker's app), and so on. Groups and chords, and chains that
contain them, are refused: they need the result backend's bookkeeping at the
moment they are applied, which a staged row cannot hold. So is
``task.chunks(it, n)``, whose ``apply_async`` sends a group (one
``celery.starmap`` task per part): stage each part as ``task.starmap(part)``.
``task.map(it)`` and ``task.starmap(it)`` are one task each (``celery.map``,
``celery.starmap``), as ``apply_async`` sends them; they are routed by that
name, where ``apply_async`` routes them by the task they map.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from drain.errors import StagingError

#: Signature options with a meaning here, and drain.stage's name for each.
_SIGNATURE_OPTIONS = {"queue": "queue", "countdown": "countdown", "eta": "eta",
                      "expires": "expires", "priority": "priority", "task_id": "task_id"}
#: Options a chain's apply_async consumes itself (celery.canvas._chain.run's
#: parameters) rather than passing to its first task.
_CHAIN_OWN_OPTIONS = ("link", "link_error", "task_id", "group_id", "chord", "group_index",
                      "root_id", "parent_id", "publisher", "producer", "app")
#: Options that name the process which built a signature (freeze() sets
#: reply_to to the app's thread id): the drain sends its own.
_SENDER_OPTIONS = ("reply_to",)
_REFUSE_CANVAS = ("stage its first task, and let that task start the rest ({kind}."
                  "apply_async in the task), or stage each task on its own")


def from_signature(signature: Mapping[str, Any]) -> dict[str, Any]:
    """:func:`stage`'s arguments for a Celery signature or chain, plus ``embed``:
    the message's embed (None: none), which drain.staging_values encodes as the
    arguments, with kombu's JSON encoder.

    Options drain cannot honour (``routing_key``, ``exchange``: route with the
    app's ``task_routes`` and ``drain run --app``), groups and chords raise
    :class:`StagingError` saying what to do instead.
    """
    kind = signature.get("subtask_type")
    if kind == "chain":
        return _from_chain(signature)
    if kind:
        raise StagingError(f"a {kind} cannot be staged: " + _REFUSE_CANVAS.format(kind=kind))
    options = dict(signature.get("options") or {})
    return _staged(signature.get("task"), signature.get("args") or (),
                   signature.get("kwargs") or None, options)


def _from_chain(chain: Any) -> dict[str, Any]:
    """The first task of ``chain`` as ``chain.apply_async()`` sends it."""
    prepare = getattr(chain, "prepare_steps", None)
    if prepare is None:
        raise StagingError("a chain given as a plain dict cannot be staged: pass the "
                           "chain itself (celery.canvas.chain, or a | b)")
    canvas = sorted(_groups_in(chain))
    if canvas:
        raise StagingError(
            f"a chain with a {' or a '.join(canvas)} in it cannot be staged: "
            + _REFUSE_CANVAS.format(kind="chain"))
    options = dict(chain.options)
    own = {key: options.pop(key, None) for key in _CHAIN_OWN_OPTIONS}
    taken = sorted(key for key in ("group_id", "chord", "group_index", "root_id", "parent_id")
                   if own[key] is not None)
    if taken:
        raise StagingError(f"a chain with option(s) {taken} cannot be staged: they belong "
                           "to a chain applied inside a group or a worker")
    # As celery.canvas._chain.run: each task cloned and frozen (its task id),
    # nested chains unrolled, link_error on every task, the chain's task_id the
    # last task's.
    tasks, _ = prepare(tuple(chain.args), {}, chain.tasks, None, None, own["link_error"],
                       chain.app, own["task_id"], None, None)
    if not tasks:
        raise StagingError("an empty chain cannot be staged")
    if own["link"]:
        tasks[0].extend_list_option("link", own["link"])
    first = tasks.pop()
    # apply_async(**options) on the first task: the chain's options over its own.
    merged = {**dict(first.options), **{k: v for k, v in options.items() if v is not None}}
    merged["chain"] = [*(merged.get("chain") or ()), *tasks]
    return _staged(first.get("task"), first.get("args") or (), first.get("kwargs") or None,
                   merged)


def _groups_in(chain: Any) -> set[str]:
    """The kinds of group (group, chord) anywhere in ``chain``'s tasks."""
    found: set[str] = set()
    for task in getattr(chain, "tasks", None) or ():
        kind = task.get("subtask_type") if isinstance(task, Mapping) else None
        if kind == "chain":
            found |= _groups_in(task)
        elif kind:
            found.add(kind)
    return found


def _staged(name: Any, args: Any, kwargs: Any, options: dict[str, Any]) -> dict[str, Any]:
    """stage()'s arguments for task ``name`` sent with these apply_async ``options``."""
    if name == "celery.chunks":
        inner = (kwargs or {}).get("task")
        task = inner.get("task") if isinstance(inner, Mapping) else None
        raise StagingError(
            f"{task or 'task'}.chunks(...) cannot be staged: its apply_async sends a group "
            f"of celery.starmap tasks, one per part; stage each part as "
            f"{task or 'task'}.starmap(part), which is one task")
    for sender in _SENDER_OPTIONS:
        options.pop(sender, None)
    callbacks = _listed(options.pop("link", None))
    errbacks = _listed(options.pop("link_error", None))
    chain = options.pop("chain", None)
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
    embed = None
    if callbacks or errbacks or chain is not None:
        for what, sigs in (("link", callbacks), ("link_error", errbacks), ("chain", chain)):
            for sig in sigs or ():
                _callable(name, what, sig)
        embed = {"callbacks": callbacks, "errbacks": errbacks, "chain": chain, "chord": None}
    return {"task_name": name, "args": args, "kwargs": kwargs, "embed": embed, **staged}


def _listed(value: Any) -> list[Any] | None:
    """Celery's ``maybe_list``: one signature is a list of one."""
    if value is None:
        return None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _callable(name: Any, what: str, sig: Any) -> None:
    """A callback or chained task must be a signature, never a group or a chord."""
    if not isinstance(sig, Mapping) or not isinstance(sig.get("task"), str):
        raise StagingError(f"{name}: {what} must hold Celery signatures, got {sig!r}")
    kind = sig.get("subtask_type")
    if kind in ("group", "chord"):
        raise StagingError(f"{name}: a {kind} as a {what} cannot be staged: "
                           + _REFUSE_CANVAS.format(kind=kind))


def _iso(task_name: Any, what: str, text: str) -> dt.datetime:
    try:
        return dt.datetime.fromisoformat(text)
    except ValueError:
        raise StagingError(f"{what} for {task_name} is not an ISO date-time: {text!r}") from None
