"""A hook that redacts job arguments before drain shows them to a person (issue 39).

Jobs carry what the application gave them: e-mail addresses, tokens, personal
data. ``drain show`` and ``drain dead list`` (and the console) print arguments,
so an operator may name a function that redacts them first::

    drain show 6b1f... --redact myproject.ops:redact     (or DRAIN_REDACT=...)

    def redact(task_name, args, kwargs):
        if task_name == "mail.send":
            return ["<address>"], {**kwargs, "token": "<redacted>"}
        return args, kwargs

It is called with the task name and the decoded ``args`` and ``kwargs`` and
returns the ``(args, kwargs)`` to show. It fails closed: when it raises, or
returns something else, nothing of the arguments is shown, only that the
redaction failed. What is published is never redacted: the hook changes what
a person sees, not the job.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable
from typing import Any

from drain.errors import ConfigError

#: ``redact(task_name, args, kwargs) -> (args, kwargs)``.
Redactor = Callable[[str, Any, Any], tuple[Any, Any]]

#: What stands for arguments whose redaction failed.
FAILED = "<redaction failed: {}>"


def load(spec: str | None) -> Redactor | None:
    """The function ``MODULE:FUNCTION`` names (None: none given); ConfigError (one
    line) when it cannot be imported or is not callable."""
    if not spec:
        return None
    module_name, _, name = spec.strip().partition(":")
    if not module_name or not name:
        raise ConfigError(f"--redact {spec!r}: give the function as MODULE:FUNCTION")
    try:
        found = getattr(importlib.import_module(module_name), name)
    except Exception as exc:  # an ImportError, an AttributeError, what the module raised
        raise ConfigError(f"--redact {spec}: cannot load it: {type(exc).__name__}: {exc}"
                          ) from None
    if not callable(found):
        raise ConfigError(f"--redact {spec}: {type(found).__name__} is not callable")
    redactor: Redactor = found
    return redactor


def shown(redactor: Redactor | None, task_name: str, args_json: str,
          kwargs_json: str) -> tuple[str, str]:
    """The arguments to show, as JSON text: as stored without a redactor; else what
    it returns, or, when it fails, a placeholder for both (never the originals)."""
    if redactor is None:
        return args_json, kwargs_json
    try:
        args, kwargs = redactor(task_name, json.loads(args_json), json.loads(kwargs_json))
        if isinstance(args, list | tuple) and isinstance(kwargs, dict):
            return json.dumps(list(args), default=str), json.dumps(kwargs, default=str)
        failure = "TypeError"  # not a list and a dict
    except Exception as exc:
        failure = type(exc).__name__
    failed = FAILED.format(failure)
    return json.dumps([failed]), json.dumps({"redaction": failed})
