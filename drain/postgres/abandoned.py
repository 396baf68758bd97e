"""Which server backend the drain may end: its session token and its lock.

When the watchdog gives up a connection that stopped answering
(drain.daemon.watchdog, ``Session.abandon``), the backend behind it may live on,
holding the drain's advisory lock: nothing would publish until the server
noticed. So the next connect ends it. But a pid (even with its start time)
does not prove that the backend is still the drain's: a session-mode PgBouncer
hands a server connection its client released to the next client that asks,
the most recently released first, so once the hung path lets go, the drain's
former backend may serve an application, a standby drain, or this drain's own
new session.

Every drain session therefore takes a *token* when it connects: an advisory
lock of its own class (:data:`TOKEN_CLASS`) on a random key, held for the
whole session. A backend is ended only while it still holds both this token
and this drain's lock (the plain lock, or its lane's), checked in pg_locks
by the very statement that ends it. A pool releasing the server connection
runs its reset (``DISCARD ALL`` by default), which drops every advisory lock
with the token, so a backend handed to anyone else can never match; the drain
leaves it and says so. A backend frozen behind a hung path (a silent cut the
pool does not see) still holds both, and is ended, so the lock comes free.

This module also names the drain's other advisory locks (the lane locks and
their guard) in pg_locks' terms.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import zlib
from collections.abc import Callable

from drain.settings.config import Settings

log = logging.getLogger("drain.session")

#: The token's class in the two-int advisory keyspace ("drnt"); the key is
#: random, one per session.
TOKEN_CLASS = 1685220980
#: Tries to find a key no other live session holds (a clash is 1 in 2**32).
_TOKEN_TRIES = 8

#: pg_locks' objsubid of a lock taken with one bigint key, and with two ints.
_ONE_KEY, _TWO_KEYS = 1, 2
_UINT32 = 0xFFFF_FFFF


@dataclasses.dataclass(frozen=True)
class Backend:
    """One drain session's server backend: its pid (``pg_backend_pid()``, the
    server's, not a pool's) and the key of the token it holds."""

    pid: int
    token: int


def new_token() -> int:
    """A random key for :data:`TOKEN_CLASS` (any int4)."""
    return secrets.randbits(32) - 2**31


def take_token(try_lock: Callable[[int], bool]) -> int:
    """Take a token with ``try_lock(key)`` (``pg_try_advisory_lock(TOKEN_CLASS,
    key)`` on the session) and return its key."""
    for _ in range(_TOKEN_TRIES):
        key = new_token()
        if try_lock(key):
            return key
    raise RuntimeError("no free session token: advisory locks of class "
                       f"{TOKEN_CLASS} are taken by something else")


def end_params(backend: Backend, settings: Settings) -> dict[str, object]:
    """The parameters of the ``end_abandoned`` query for ``backend``."""
    return {"pid": backend.pid, "token_class": TOKEN_CLASS, "token": backend.token,
            **leader_lock(settings)}


def leader_lock(settings: Settings) -> dict[str, int]:
    """The drain's lock (the lock key's, or with lanes, this lane's) as pg_locks
    shows it: ``lock_classid``, ``lock_objid``, ``lock_objsubid``."""
    if settings.lanes == 1:
        key = settings.lock_key & 0xFFFF_FFFF_FFFF_FFFF
        return {"lock_classid": key >> 32, "lock_objid": key & _UINT32,
                "lock_objsubid": _ONE_KEY}
    return {"lock_classid": lane_class(settings.lock_key, settings.lanes) & _UINT32,
            "lock_objid": settings.lane & _UINT32, "lock_objsubid": _TWO_KEYS}


def report(backend: Backend, ended: bool) -> None:
    """Say what became of an abandoned backend at the next connect."""
    if ended:
        log.warning("ended this drain's abandoned session (backend pid %s): it was still "
                    "open behind the hang, holding the lock", backend.pid)
    else:
        log.warning("left backend pid %s alone: it no longer holds this drain's lock and "
                    "session token (it ended, or a pool gave the server connection to "
                    "another client)", backend.pid)


def lane_guard(lock_key: int) -> int:
    """The int4 class of the (guard, lanes) locks of a lock key."""
    return _int4(f"drain lanes {lock_key}")


def lane_class(lock_key: int, lanes: int) -> int:
    """The int4 class of the (class, lane) locks of a lock key split in ``lanes``."""
    return _int4(f"drain lane {lock_key}/{lanes}")


def _int4(text: str) -> int:
    value = zlib.crc32(text.encode())
    return value - 2**32 if value >= 2**31 else value
