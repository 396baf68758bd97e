"""A backfill's Spark jobs in one job group: a one-line progress bar on stderr (local
mode, at a terminal), and after a failure, a wait for the group's tasks still running.

Spark fails a job as soon as one task has failed for good and kills the others
without waiting: a partition whose Python worker is inside its COPY may still
commit in the seconds after (up to ``spark.python.task.killTimeout``, 2 s by
default, before its worker is killed). Waiting for those tasks keeps the promise
the error makes: once it is reported, nothing of the run is written any more, so
a re-run started at once does not race the failed one's partitions.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pyspark import SparkContext, SparkStageInfo

_WIDTH = 30
#: How long a failed run waits for its killed tasks to end.
SETTLE_SECONDS = 60.0

log = logging.getLogger(__name__)


def bar(done: int, total: int, what: str) -> str:
    """``[#######.......]  12/64 partitions``."""
    filled = _WIDTH * done // total if total else 0
    return f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {done:>{len(str(total))}}/{total} {what}"


@contextlib.contextmanager
def tracking(
    sc: SparkContext, description: str, *, enabled: bool, stream: TextIO | None = None,
    interval: float = 0.5,
) -> Iterator[str]:
    """Run the body's Spark jobs in a job group; while it runs, redraw the bar of the
    group's latest stage every ``interval`` seconds (when ``enabled``). When the body
    raises, wait (up to :data:`SETTLE_SECONDS`) until none of the group's tasks runs.
    Yields the group's id."""
    group = f"drain-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, description)
    out = stream or sys.stderr
    stop = threading.Event()

    def draw() -> None:
        shown = False
        while not stop.wait(interval):
            stages = [info for info in _stages(sc, group) if info.numTasks]
            if stages:
                stage = max(stages, key=lambda s: s.stageId)
                out.write(f"\r{description}: stage {stage.stageId} "
                          + bar(stage.numCompletedTasks, stage.numTasks, "tasks"))
                out.flush()
                shown = True
        if shown:
            out.write("\n")
            out.flush()

    thread = threading.Thread(target=draw, name="drain-progress", daemon=True)
    if enabled:
        thread.start()
    try:
        yield group
    except Exception:  # not on Ctrl-C: who stops the run does not want to wait
        settle(sc, group)
        raise
    finally:
        stop.set()
        if enabled:
            thread.join()
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]


def _stages(sc: SparkContext, group: str) -> Iterator[SparkStageInfo]:
    """What the status tracker knows of the job group's stages."""
    tracker = sc.statusTracker()
    for job_id in tracker.getJobIdsForGroup(group):
        job = tracker.getJobInfo(job_id)
        for stage_id in job.stageIds if job is not None else ():
            info = tracker.getStageInfo(stage_id)
            if info is not None:
                yield info


def active_tasks(sc: SparkContext, group: str) -> int:
    """Tasks of the job group's stages that have started and not ended."""
    return sum(info.numActiveTasks for info in _stages(sc, group))


def settle(sc: SparkContext, group: str, timeout: float = SETTLE_SECONDS,
           interval: float = 0.1) -> bool:
    """Wait until none of ``group``'s tasks runs; False (and a warning) after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            running = active_tasks(sc, group)
        except Exception:  # the context is gone (the JVM died): nothing of it runs
            return True
        if not running:
            return True
        if time.monotonic() > deadline:
            log.warning("%d task(s) of the failed backfill still run after %.0f s; a "
                        "re-run started now may find their partitions committed", running,
                        timeout)
            return False
        time.sleep(interval)
