"""drain-outbox built from this checkout and installed from its wheel into a clean venv.

One build (the sdist, then the wheel built from that sdist, as ``python -m build``
does: so the sdist holds what a build needs) and one venv: ``python -m venv``
without system site packages, ``pip install <wheel>`` (dependencies from the
package index or pip's cache): drain's runtime dependencies and nothing else (a test
that needs more installs it, as test_wheel.py does pytest for drain's pytest plugin).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from tests import support

DISTRIBUTION = "drain-outbox"


@dataclasses.dataclass(frozen=True)
class Installed:
    wheel: Path
    sdist: Path
    venv: Path
    cwd: Path  # empty: nothing importable

    @property
    def drain(self) -> str:
        return str(self.venv / "bin" / "drain")

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def env(self, db_url: str, role: str, **extra: str) -> dict[str, str]:
        env = support.drain_env(db_url, role, **extra)
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(name, None)
        return env

    def run(self, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(argv, env=env, cwd=self.cwd, capture_output=True, text=True,
                              timeout=300, check=False, stdin=subprocess.DEVNULL)


def checked(argv: list[str], env: dict[str, str] | None = None) -> None:
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stderr[-3000:]}"


def build_and_install(root: Path, source: Path = support.ROOT) -> Installed:
    """drain-outbox built from ``source`` (this checkout; tests/previous.py gives an
    older release's tree) and installed from its wheel into a clean venv in ``root``."""
    dist = root / "dist"
    checked([sys.executable, "-m", "build", "--outdir", str(dist), str(source)])
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    venv = root / "venv"
    # This interpreter's pip installs into the venv (--python): the same install as the
    # venv's own pip would do, without the ~10 s of seeding pip into it.
    checked([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    checked([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
              "install", "--quiet", str(wheel)], env=env)
    cwd = root / "cwd"
    cwd.mkdir()
    return Installed(wheel, sdist, venv, cwd)
