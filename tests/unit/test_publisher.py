"""drain.broker.publisher.coalesce: the frames of a batch joined before they are sent."""

from __future__ import annotations

import collections
import types

from drain.broker import publisher


def _conn(buffers: list[bytes]) -> types.SimpleNamespace:
    transport = types.SimpleNamespace(_tx_buffers=collections.deque(buffers))
    return types.SimpleNamespace(_transport=transport)


def test_frames_are_joined_into_chunks_with_the_same_bytes_in_the_same_order() -> None:
    frames = [bytes([i % 251]) * (1 + i % 7) for i in range(3000)]
    conn = _conn(frames)
    publisher.coalesce(conn, limit=1000)
    chunks = list(conn._transport._tx_buffers)
    assert b"".join(chunks) == b"".join(frames)
    assert len(chunks) < len(frames) / 100
    # Each chunk closes as soon as it reaches the limit: at most one frame over it.
    assert all(1000 <= len(c) < 1000 + 7 for c in chunks[:-1])
    assert 0 < len(chunks[-1]) < 1000 + 7


def test_a_buffer_larger_than_the_limit_stays_whole_and_in_place() -> None:
    frames = [b"rest of a partial send", b"x" * 5000, b"a", b"b"]
    conn = _conn(frames)
    publisher.coalesce(conn, limit=100)
    assert list(conn._transport._tx_buffers) == [b"rest of a partial send" + b"x" * 5000,
                                                 b"ab"]


def test_nothing_is_done_without_two_buffers_or_without_pikas_transport() -> None:
    single = _conn([b"only"])
    publisher.coalesce(single)
    assert list(single._transport._tx_buffers) == [b"only"]
    for other in (None, object(), types.SimpleNamespace(_transport=None)):
        publisher.coalesce(other)  # no error, nothing to join
    listed = types.SimpleNamespace(_transport=types.SimpleNamespace(_tx_buffers=[b"a", b"b"]))
    publisher.coalesce(listed)
    assert listed._transport._tx_buffers == [b"a", b"b"]
