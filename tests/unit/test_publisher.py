"""drain.broker.corked: the frames of a batch joined before they are sent."""

from __future__ import annotations

from typing import Any

from drain.broker import corked


class _Transport:
    """Records what pika's transport would be asked to send."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.aborted = False

    def write(self, data: bytes) -> None:
        self.sent.append(data)

    def get_write_buffer_size(self) -> int:
        return sum(map(len, self.sent))

    def abort(self) -> None:
        self.aborted = True


def _corked() -> tuple[corked.CorkedTransport, _Transport]:
    inner = _Transport()
    protocol: Any = object()
    return corked.CorkedTransport(inner, protocol), inner


def test_frames_are_joined_into_chunks_with_the_same_bytes_in_the_same_order() -> None:
    frames = [bytes([i % 251]) * (1 + i % 7) for i in range(3000)]
    chunks = corked.coalesce(frames, limit=1000)
    assert b"".join(chunks) == b"".join(frames)
    assert len(chunks) < len(frames) / 100
    # Each chunk closes as soon as it reaches the limit: at most one frame over it.
    assert all(1000 <= len(c) < 1000 + 7 for c in chunks[:-1])
    assert 0 < len(chunks[-1]) < 1000 + 7


def test_a_frame_larger_than_the_limit_stays_whole_and_in_place() -> None:
    frames = [b"first", b"x" * 5000, b"a", b"b"]
    assert corked.coalesce(frames, limit=100) == [b"first" + b"x" * 5000, b"ab"]
    assert corked.coalesce([], limit=100) == []


def test_writes_pass_straight_through_unless_corked() -> None:
    transport, inner = _corked()
    transport.write(b"heartbeat")
    assert inner.sent == [b"heartbeat"]
    transport.cork()
    for i in range(300):
        transport.write(b"frame%d;" % i)
    assert inner.sent == [b"heartbeat"], "nothing goes out while corked"
    assert transport.get_write_buffer_size() == len(b"heartbeat") + sum(
        len(b"frame%d;" % i) for i in range(300))
    assert transport.uncork(limit=1000) == 300
    assert b"".join(inner.sent) == b"heartbeat" + b"".join(b"frame%d;" % i for i in range(300))
    assert 1 + 2 <= len(inner.sent) <= 1 + 3
    assert transport.writes == len(inner.sent)
    transport.write(b"after")
    assert inner.sent[-1] == b"after", "uncorked: straight through again"
    assert transport.uncork() == 0


def test_an_abort_drops_what_was_held() -> None:
    transport, inner = _corked()
    transport.cork()
    transport.write(b"never sent")
    transport.abort()
    assert inner.aborted
    assert transport.uncork() == 0
    assert inner.sent == []
    assert transport.get_write_buffer_size() == 0
