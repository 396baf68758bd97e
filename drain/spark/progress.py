"""A one-line progress bar on stderr, from Spark's status tracker (local mode, at a terminal)."""

from __future__ import annotations

import contextlib
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from pyspark import SparkContext

_WIDTH = 30


def bar(done: int, total: int, what: str) -> str:
    """``[#######.......]  12/64 partitions``."""
    filled = _WIDTH * done // total if total else 0
    return f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {done:>{len(str(total))}}/{total} {what}"


@contextlib.contextmanager
def tracking(
    sc: SparkContext, description: str, *, enabled: bool, stream: TextIO | None = None,
    interval: float = 0.5,
) -> Iterator[None]:
    """Run the body's Spark jobs in a job group; while it runs, redraw the bar of the
    group's latest stage every ``interval`` seconds (when ``enabled``)."""
    group = f"drain-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, description)
    out = stream or sys.stderr
    stop = threading.Event()

    def draw() -> None:
        tracker = sc.statusTracker()
        shown = False
        while not stop.wait(interval):
            stages = [
                info
                for job_id in tracker.getJobIdsForGroup(group)
                if (job := tracker.getJobInfo(job_id)) is not None
                for stage_id in job.stageIds
                if (info := tracker.getStageInfo(stage_id)) is not None and info.numTasks
            ]
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
        yield
    finally:
        stop.set()
        if enabled:
            thread.join()
        sc.setLocalProperty("spark.jobGroup.id", None)  # type: ignore[arg-type]
