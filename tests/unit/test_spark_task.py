"""drain.spark.task: an attempt's identity from a TaskContext, and a cut Arrow stream.

Spark's attemptNumber() starts again at 0 in a new attempt of the stage (after
a fetch failure: an executor lost with its shuffle output), so it cannot tell
two attempts at a partition apart; taskAttemptId() can.
"""

from __future__ import annotations

import dataclasses
import io

import pytest

from drain.spark import task


@dataclasses.dataclass
class FakeContext:
    """The two values of a pyspark TaskContext that drain reads (pyspark's names)."""

    number: int
    tid: int

    def attemptNumber(self) -> int:
        return self.number

    def taskAttemptId(self) -> int:
        return self.tid


def test_a_retry_in_a_new_stage_attempt_has_its_own_identity() -> None:
    # Stage attempt 0: TID 1 fails; stage attempt 1 runs the partition again as TID 3.
    first, retry = task.attempt(FakeContext(0, 1)), task.attempt(FakeContext(0, 3))
    assert first.number == retry.number == 0
    assert first != retry
    assert (retry.number, retry.task_attempt_id) == (0, 3)


def test_outside_a_spark_task_there_is_no_task_attempt_id() -> None:
    assert task.attempt(None) == task.Attempt(0, None)


def _stream() -> bytes:
    pa = pytest.importorskip("pyarrow")
    table = pa.table({"line": [f"line {i}\n" for i in range(100)]})
    sink = io.BytesIO()
    with pa.ipc.new_stream(sink, table.schema) as out:
        for batch in table.to_batches(max_chunksize=10):
            out.write_batch(batch)
    return sink.getvalue()


def test_every_cut_inside_a_message_is_recognised_and_nothing_else() -> None:
    pa = pytest.importorskip("pyarrow")
    data = _stream()
    cut_inside = clean_ends = 0
    for end in range(len(data)):
        try:
            reader = pa.ipc.open_stream(io.BytesIO(data[:end]))
            for _ in reader:
                pass
        except (pa.ArrowInvalid, OSError) as exc:
            assert task.cut_stream(exc), exc
            cut_inside += 1
        else:
            clean_ends += 1  # cut between two messages: the record count's case
    assert cut_inside > 0 and clean_ends > 0
    assert not task.cut_stream(pa.ArrowInvalid("Column 1: Invalid UTF8 payload"))
    assert not task.cut_stream(ValueError("Tried reading schema message, was null or length 0"))


@pytest.mark.parametrize(("states", "expected"), [
    # worker <- daemon (S) <- JVM (S): the chain as it was.
    ({200: ("S", 100), 100: ("S", 1)}, (200, 100)),
    # The JVM's main thread is a zombie, its children not yet reparented.
    ({200: ("S", 100), 100: ("Z", 1)}, (200, -1)),
    # The daemon itself has exited, or cannot be read.
    ({200: ("Z", 100), 100: ("S", 1)}, (200, -1)),
    ({100: ("S", 1)}, (200, -1)),
])
def test_a_feeder_that_has_exited_counts_as_gone(
    monkeypatch: pytest.MonkeyPatch, states: dict[int, tuple[str, int]],
    expected: tuple[int, int],
) -> None:
    """A killed JVM's main thread is a zombie before its children are reparented:
    the pair must change then, or an orphaned writer commits (test_lost)."""
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.setattr("os.getppid", lambda: 200)
    monkeypatch.setattr(task, "_state_and_parent", lambda pid: states.get(pid, ("X", -1)))
    assert task.feeder() == expected


def test_the_feeder_of_this_process_is_alive() -> None:
    """The real /proc read: pytest's parent chain is alive, so no -1."""
    chain = task.feeder()
    assert chain is not None and chain[1] != -1
