"""The previous release of drain, built from the project's own git history.

The version-skew and rolling-deploy tests (tests/acceptance/test_version_skew.py,
test_rolling_deploy.py) run this release beside the checkout: its ``drain``
command, its ``drain migrate`` and its ``stage()``. It is a fixed commit,
:data:`COMMIT`, exported with ``git archive``, built and installed with its
dependencies into a venv of its own as this checkout's wheel is
(tests/package/installed.py), as a user's deployment of it is. Nothing of it is checked in.

The build takes half a minute, once: it is kept in ``build/previous/<commit>``
(``build/`` is ignored by git) and reused by later runs; parallel test workers
wait for each other on a lock file, so one of them builds it. A checkout
without that commit (a shallow clone) fails the tests that need it, saying so.

What changed since that release, and what each skew does, is CHANGELOG.md's
"Upgrading" entry and docs/running.md's "Upgrading".
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess

import pytest

from tests import support
from tests.package.installed import Installed, build_and_install, checked

#: 0.1.0: the last commit before the trace column, the recorded schema version and the
#: per-database role prefix (staging_schema.sql); its roles are named drain_* in every
#: database, and it knows no schema version.
COMMIT = "0ff46749e32b17608965ebda95ec0f06e51becfd"
VERSION = "0.1.0"
#: Where built releases are kept between runs.
CACHE = support.ROOT / "build" / "previous"


def build() -> Installed:
    """The previous release, built and installed if it is not yet (module docstring)."""
    home = CACHE / COMMIT
    ready = home / "ready"
    CACHE.mkdir(parents=True, exist_ok=True)
    with (CACHE / f"{COMMIT}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if ready.exists():
            (wheel,) = (home / "dist").glob("*.whl")
            (sdist,) = (home / "dist").glob("*.tar.gz")
            return Installed(wheel, sdist, home / "venv", home / "cwd")
        shutil.rmtree(home, ignore_errors=True)
        src = home / "src"
        src.mkdir(parents=True)
        tar = home / "src.tar"
        archive = subprocess.run(["git", "archive", "--format=tar", f"--output={tar}", COMMIT],
                                 cwd=support.ROOT, capture_output=True, text=True, check=False)
        if archive.returncode != 0:
            pytest.fail(f"git archive {COMMIT[:10]} (drain {VERSION}, the previous release): "
                        f"{archive.stderr.strip()}; the version-skew tests need the project's "
                        "git history (not a shallow clone)")
        checked(["tar", "-x", "-f", str(tar), "-C", str(src)])
        release = build_and_install(home, source=src)
        ready.touch()
        return release
