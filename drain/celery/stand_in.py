"""Does a router function look at a task's arguments? Ask it with stand-ins.

A Celery router function is called as ``route(name, args, kwargs, options,
task=...)``, and may route by anything it is given. With ``--app``, the rows
routed to a queue the broker refuses are held out of the fetch
(drain.daemon.piles): by *route* (task name and staged queue) when every row
of that route goes there, else one by one, by id, each row fetched and routed
once. Held one by one, a pile of 100,000 such rows is a walk of 100 batches
before the rows behind it (issue 36, "curves").

Plain ``task_routes`` mappings route by name only, so their rows are held by
route. A router function may look at the arguments, but most do not (they
route by name, as Celery's documentation shows them). :func:`ignores_arguments`
finds out which: it asks Celery's router for the task with a :class:`StandIn`
for ``args`` and one for ``kwargs``. A stand-in records any use of itself and
raises: reading an item, its length or truth, iterating, comparing, hashing,
printing, copying, any attribute, ``isinstance`` (which reads ``__class__``).
A router that answered without using either routed the task by what every
row of it shares (its name, the task, the options), so every row of the
route gets that answer.

What a stand-in cannot see: ``type(args) is ...`` and identity tests
(``args is None``). A router that routes by something outside the row (the
time, a flag it reads) can change its answer while rows are held by route:
the drain asks again (drain.daemon.piles, ``recheck``) and lets the route's
rows be fetched again once the answer changed.
"""

from __future__ import annotations

from typing import Any, NoReturn

from celery.app.routes import Router


class Looked(Exception):
    """A router used a stand-in: it looks at the arguments."""


class StandIn:
    """Stands in for a row's ``args`` or ``kwargs``: any use is recorded, then raises."""

    __slots__ = ("used",)

    def __init__(self) -> None:
        object.__setattr__(self, "used", False)

    def _use(self, *_: Any, **__: Any) -> NoReturn:
        object.__setattr__(self, "used", True)
        raise Looked

    def __getattribute__(self, name: str) -> Any:
        if name == "used":
            return object.__getattribute__(self, name)
        object.__setattr__(self, "used", True)
        raise Looked(name)

    # The operations the interpreter looks up on the type, not through __getattribute__.
    __len__ = __bool__ = __iter__ = __reversed__ = __contains__ = _use
    __getitem__ = __setitem__ = __delitem__ = __missing__ = _use
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __hash__ = _use
    __repr__ = __str__ = __format__ = __bytes__ = _use
    __add__ = __radd__ = __mul__ = __rmul__ = __or__ = __ror__ = __and__ = __rand__ = _use
    __copy__ = __deepcopy__ = __reduce__ = __reduce_ex__ = __getstate__ = _use
    __setattr__ = __delattr__ = __dir__ = __sizeof__ = __index__ = __int__ = _use


def ignores_arguments(router: Router, name: str, options: dict[str, Any], task: Any) -> bool:
    """Whether Celery's ``router`` routes task ``name`` (with the options
    ``apply_async`` starts from, and the registered ``task``) without looking
    at its arguments. A router that raises counts as looking: nothing is
    concluded from it."""
    args, kwargs = StandIn(), StandIn()
    try:
        # What Router.route does before it asks the routes, less its own look at
        # kwargs (``not kwargs``): the options expanded, then each route in turn.
        expanded = router.expand_destination(dict(options))
        router.lookup_route(name, args, kwargs, expanded, task)
    except Exception:
        return False
    return not (args.used or kwargs.used)
