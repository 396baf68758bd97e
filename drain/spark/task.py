"""What a backfill partition's writer, on an executor, knows about its Spark task.

* Its partition (``TaskContext.partitionId()``).
* Its attempt (:class:`Attempt`). Spark's ``attemptNumber()`` counts the
  attempts at a task within one attempt of its stage and starts again at 0
  when the stage is attempted again (after a fetch failure, which is what an
  executor lost with its shuffle output causes, or a barrier stage's retry):
  two attempts at one partition can both read 0. The JVM's
  ``stageAttemptNumber()`` would tell them apart, but pyspark's TaskContext
  does not pass it to Python workers (pyspark 4.3 gives the stage id,
  partition id, attempt number and task attempt id); ``taskAttemptId()``,
  Spark's task id ("TID" in its logs and UI), is unique per attempt within
  the application, and so across stage attempts: drain records both.
* The process chain that feeds it (:func:`feeder`), to tell a dead executor's
  cut input from a clean end, and the errors of an Arrow input stream cut
  inside a message (:func:`cut_stream`).
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import sys
from pathlib import Path
from typing import Any, Protocol


class TaskContextLike(Protocol):
    """The part of ``pyspark.TaskContext`` :func:`attempt` reads (pyspark's names)."""

    def attemptNumber(self) -> int: ...

    def taskAttemptId(self) -> int: ...


@dataclasses.dataclass(frozen=True)
class Attempt:
    """One Spark attempt at a task, as ``drain_backfill_attempts`` records it."""

    #: ``attemptNumber()``: 0 for the first attempt within a stage attempt (so 0 again
    #: after the stage is attempted again).
    number: int
    #: ``taskAttemptId()``: unique per attempt in the Spark application; None outside
    #: a Spark task.
    task_attempt_id: int | None


def attempt(context: TaskContextLike | None) -> Attempt:
    """The attempt ``context`` runs (``TaskContext.get()``; None outside a Spark task)."""
    if context is None:
        return Attempt(0, None)
    return Attempt(int(context.attemptNumber()), int(context.taskAttemptId()))


def current_context() -> Any:
    """``pyspark.TaskContext.get()``: None outside a Spark task."""
    from pyspark import TaskContext  # noqa: PLC0415 - pyspark is optional

    return TaskContext.get()


def current_attempt() -> Attempt:
    """This Python worker's task attempt."""
    return attempt(current_context())


def partition_id() -> int:
    """This Python worker's task's partition."""
    context = current_context()
    assert context is not None, "not in a Spark task"
    return int(context.partitionId())


def host() -> str:
    """Where this attempt runs: host name and Python worker pid."""
    return f"{socket.gethostname()} pid {os.getpid()}"


def feeder() -> tuple[int, int] | None:
    """This Python worker's parent and grandparent (Linux; None elsewhere).

    pyspark's Python workers are forked by its daemon, itself a child of the
    executor JVM (or by the JVM directly). When that JVM dies, its sockets
    close: an input stream cut at a batch boundary reads as a clean end
    (Arrow and pickled batches alike), so a partition could look complete.
    The dead JVM's children are reparented, so a changed pair means: do not
    commit. A killed JVM's main thread is a zombie before its other threads
    have ended and its children are reparented (a while, for a large heap under
    load): a parent or grandparent in that state counts as gone (-1).
    """
    if not sys.platform.startswith("linux"):
        return None
    parent = os.getppid()
    state, grandparent = _state_and_parent(parent)
    if state in _GONE or exited(grandparent):
        return (parent, -1)
    return (parent, grandparent)


#: /proc states of a process that has exited (zombie, dead) or cannot be read.
_GONE = frozenset("ZX")


def exited(pid: int) -> bool:
    """``pid`` has exited: reaped, or a zombie (Linux /proc)."""
    return _state_and_parent(pid)[0] in _GONE


def _state_and_parent(pid: int) -> tuple[str, int]:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ("X", -1)
    # pid (comm) state ppid ...: comm may contain spaces and parentheses.
    fields = stat.rsplit(")", 1)[1].split()
    return (fields[0], int(fields[1]))


#: pyarrow's words for an IPC stream that ends inside a message (checked with pyarrow
#: 26 on streams cut at every offset): before its schema ("Tried reading schema
#: message, was null or length 0"), in a message's length or metadata, or in its body.
_CUT_STREAM = re.compile(
    r"was null or length 0|only \d+ bytes available|but only read \d+|"
    r"bytes for message body, got \d+"
)


def cut_stream(exc: BaseException) -> bool:
    """True when ``exc``, raised while reading a task's Arrow input, says the stream
    ended inside a message: the executor JVM writing it closed its socket (it died,
    or lost the shuffle block it was sending). A stream cut between two messages
    reads as a clean end instead (the writer's record count catches that)."""
    import pyarrow as pa  # noqa: PLC0415 - pyarrow is optional

    return isinstance(exc, (pa.ArrowInvalid, OSError)) and bool(_CUT_STREAM.search(str(exc)))
