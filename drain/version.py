"""drain's version: the installed distribution's, so ``drain --version`` says what pip says.

drain is published on the package index as ``drain-outbox`` (the name ``drain`` belongs
to an unrelated project there); the import name and the command stay ``drain``. The
version comes from the installed distribution's metadata, where the build wrote it:
git's, by hatch-vcs (``pyproject.toml``, ``[tool.hatch.version]``): ``X.Y.Z`` built from
the commit tagged ``vX.Y.Z``, else a dev version of the next release
(``0.2.0.dev12+g1a2b3c4``); an sdist carries it in PKG-INFO. An editable install keeps
the version of its install (``pip install -e`` again to see a new tag). A source tree
imported without installing it (``PYTHONPATH``, or the ``drain.zip`` that Spark
executors import) has no such metadata and says so instead of guessing.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any, NoReturn

#: The name to ``pip install``: ``pip install drain-outbox``, ``'drain-outbox[spark]'``.
DISTRIBUTION = "drain-outbox"
#: A PEP 440 version that sorts before every release: drain is not installed.
UNKNOWN = "0+unknown"
#: The unrelated project holding the name ``drain`` on the package index (0.0.6, a
#: "pipeline library"). It installs a ``drain`` package and a ``drain`` script too:
#: installed beside drain-outbox, each overwrites files of the other.
UNRELATED = "drain"


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


def clash() -> str | None:
    """What to do when the unrelated ``drain`` distribution is installed here too."""
    try:
        other = metadata.version(UNRELATED)
    except metadata.PackageNotFoundError:
        return None
    return (f"warning: the package {UNRELATED} {other} (not this drain) is installed here too "
            f"and shares the drain/ directory and the drain command: pip uninstall "
            f"{UNRELATED}, then pip install --force-reinstall {DISTRIBUTION}")


class VersionAction(argparse.Action):
    """``--version``: :func:`describe` on stdout, and :func:`clash`'s warning on stderr,
    looked up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 **_: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="show the version (of the drain-outbox package) and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> NoReturn:
        print(describe())
        warning = clash()
        if warning:
            print(warning, file=sys.stderr)
        parser.exit()
