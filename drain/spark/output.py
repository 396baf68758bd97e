"""Where a Spark command's result goes: stdout, and a file of its own (``--json-file``).

Under ``spark-submit`` the driver's Python is a child of Spark's PythonRunner,
which merges the child's stderr into its stdout and copies both to
spark-submit's stdout: drain's one-line error (and any warning) lands in the
same stream as ``--json``'s object, so ``... --json > out.json 2> err.log``
puts the error inside out.json (spark-submit's own log lines are the only
thing on its stderr). ``--json-file PATH`` writes the object to PATH instead,
the same under spark-submit and the ``drain`` command: only on success, and
atomically (a temporary file in PATH's directory, flushed to disk, renamed
over PATH), so a reader finds the whole report of the last successful run or
no file; a failed run leaves an earlier file as it was and exits non-zero
(spark-submit exits with the driver's code in client mode).
"""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

from drain.errors import DrainError, UsageError
from drain.settings.url_parts import first_line


def check_writable(path: str | None, flag: str) -> None:
    """Refuse (UsageError) a ``flag`` PATH that cannot be written, before any work."""
    if path is None:
        return
    target = Path(path)
    directory = target.parent
    if target.is_dir():
        raise UsageError(f"{flag} {path}: is a directory")
    if not directory.is_dir():
        raise UsageError(f"{flag} {path}: no such directory {str(directory)!r}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory {str(directory)!r} is not writable")


def write_json(path: str, obj: Any, flag: str, *, indent: int | None = None) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (DrainError naming ``flag`` if not)."""
    target = Path(path)
    temporary = target.with_name(f".{target.name}.{uuid.uuid4().hex[:12]}.tmp")
    text = json.dumps(obj, sort_keys=True, default=str, indent=indent) + "\n"
    try:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise DrainError(
            f"{flag} {path}: the result could not be written ({first_line(exc)}); the run "
            "itself finished, its summary is on stdout"
        ) from None


def emit(obj: dict[str, Any], text: str, *, as_json: bool, json_file: str | None) -> None:
    """Print ``text`` (the object as one JSON line with ``as_json``), then write the
    object to ``json_file``."""
    print(json.dumps(obj, sort_keys=True, default=str) if as_json else text)
    if json_file is not None:
        write_json(json_file, obj, "--json-file")
