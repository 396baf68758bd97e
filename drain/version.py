"""drain's version: the installed distribution's, so ``drain --version`` says what pip says.

drain is published on the package index as ``drain-outbox`` (the name ``drain`` belongs
to an unrelated project there); the import name and the command stay ``drain``. The
version comes from the installed distribution's metadata, the one place it is kept
(``pyproject.toml`` writes it there). A source tree imported without installing it
(``PYTHONPATH``, or the ``drain.zip`` that Spark executors import) has no such metadata
and says so instead of guessing.
"""

from __future__ import annotations

from importlib import metadata

#: The name to ``pip install``: ``pip install drain-outbox``, ``'drain-outbox[spark]'``.
DISTRIBUTION = "drain-outbox"
#: A PEP 440 version that sorts before every release: drain is not installed.
UNKNOWN = "0+unknown"


def installed() -> str:
    """The installed ``drain-outbox`` version, or :data:`UNKNOWN`."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return UNKNOWN


VERSION = installed()


def describe() -> str:
    """What ``drain --version`` prints."""
    if VERSION == UNKNOWN:
        return f"drain {UNKNOWN} ({DISTRIBUTION} is not installed: a source tree)"
    return f"drain {VERSION} ({DISTRIBUTION})"
