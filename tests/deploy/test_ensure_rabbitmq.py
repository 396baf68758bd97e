"""deploy/ensure-services.sh starts an installed RabbitMQ with file descriptors enough
for many queues (RABBITMQ_NOFILE, within the hard limit), as the rabbitmq user when
run as root: Debian's own script goes through su, whose PAM limits give it 1,024.

The rabbitmq-server here is a stand-in on PATH that records what it was started
with; the real broker is left alone. Nothing answers on the port given, so the
script reports the broker missing after its (short) wait.
"""

from __future__ import annotations

import os
import pwd
import resource
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy import common
from tests.machine import free_port

SCRIPT = common.DEPLOY / "ensure-services.sh"
WANTED = 65536


@pytest.fixture
def stand_in() -> Iterator[Path]:
    """A world-readable directory holding a fake rabbitmq-server, which writes its
    user id and ``ulimit -n`` to ``started`` there."""
    folder = Path(tempfile.mkdtemp(prefix="drain-ensure-"))
    folder.chmod(0o777)
    fake = folder / "rabbitmq-server"
    fake.write_text(f'#!/bin/sh\necho "$(id -u) $(ulimit -n)" > {folder}/started\n')
    fake.chmod(0o755)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_an_installed_broker_is_started_with_enough_file_descriptors(stand_in: Path) -> None:
    env = {**os.environ, "PATH": f"{stand_in}:{os.environ['PATH']}",
           "DRAIN_AMQP_PORT": str(free_port()), "DRAIN_SERVICES_TIMEOUT": "1"}
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr  # nothing answers on that port
    assert "rabbitmq: MISSING" in done.stderr
    user, limit = (stand_in / "started").read_text().split()
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert int(limit) == (WANTED if hard == resource.RLIM_INFINITY else min(WANTED, hard))
    if os.getuid() == 0 and _has_user("rabbitmq") and shutil.which("setpriv"):
        assert int(user) == pwd.getpwnam("rabbitmq").pw_uid
    else:
        assert int(user) == os.getuid()


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
