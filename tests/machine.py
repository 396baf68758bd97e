"""What the tests use of the machine itself: free ports, and rabbitmqctl.

Nothing here reads the run's settings (tests/services.py sets them), so the
services plugin, which runs before they exist, uses it as every test does.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
from pathlib import Path

_PORTS = random.SystemRandom()
#: The ports free_port() handed out in this process.
_HANDED_OUT: set[int] = set()
#: free_port()'s ports start here and end below the ephemeral range.
_FIRST_PORT = 10000


def ephemeral_low() -> int:
    """The first port of the range the kernel picks a connection's local port from."""
    try:
        text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
        return int(text.split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now, for a server a test is about to start.

    Drawn at random below the kernel's ephemeral range, so that no connection
    made meanwhile takes it as its local port (a ``bind`` to port 0 draws from
    that range, and only odd ports); never one handed out before in this process
    (two calls before either server binds would otherwise get the same one);
    under pytest-xdist, only ports whose remainder by the worker count is this
    worker's number, so that two workers never get the same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) % count if worker.startswith("gw") else 0
    slots = (ephemeral_low() - _FIRST_PORT) // count
    while True:
        port = _FIRST_PORT + _PORTS.randrange(slots) * count + index
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port


def rabbitmqctl(*args: str) -> str:
    """``rabbitmqctl -q ARGS``'s output (stripped); RuntimeError, with its stderr, if it
    fails."""
    done = subprocess.run(["rabbitmqctl", "-q", *args], capture_output=True, text=True,
                          timeout=60, check=False, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"rabbitmqctl {' '.join(args)} failed: {done.stderr.strip()}")
    return done.stdout.strip()
