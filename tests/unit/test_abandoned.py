"""drain.postgres.abandoned: the drain's lock in pg_locks' terms, and the session token."""

from __future__ import annotations

from drain.postgres import abandoned
from drain.settings.config import Settings


def test_a_bigint_lock_key_as_pg_locks_shows_it() -> None:
    # Read from pg_locks after SELECT pg_advisory_lock(-7236969102118146416).
    lock = abandoned.leader_lock(Settings(lock_key=-7236969102118146416))
    assert lock == {"lock_classid": 2609979121, "lock_objid": 3653578384, "lock_objsubid": 1}


def test_a_lane_lock_as_pg_locks_shows_it() -> None:
    settings = Settings(lanes=4, lane=3)
    lock = abandoned.leader_lock(settings)
    assert lock == {"lock_classid": abandoned.lane_class(settings.lock_key, 4) & 0xFFFFFFFF,
                    "lock_objid": 3, "lock_objsubid": 2}


def test_tokens_are_int4_and_a_taken_key_is_skipped() -> None:
    assert all(-(2**31) <= abandoned.new_token() < 2**31 for _ in range(1000))
    tried: list[int] = []

    def try_lock(key: int) -> bool:
        tried.append(key)
        return len(tried) == 3  # the first two keys are held by other sessions

    key = abandoned.take_token(try_lock)
    assert key == tried[-1] and len(tried) == 3
