"""Where a benchmark run's CPU went: this process, RabbitMQ, Postgres, the machine.

Read from /proc (Linux): a process's user + system time, and its reaped
children's (so a Postgres backend that exited during the run still counts,
through the postmaster); the machine's busy share from /proc/stat. On a
machine whose cores are all busy, throughput is set by the CPU each message
costs all of them together, so this is what a rate has to be explained by.
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

TICK = float(os.sysconf("SC_CLK_TCK"))


def process_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` (and its reaped children); 0 if gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)"; fields from state on
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + (cutime + cstime if children else 0)) / TICK


def pids_named(name: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def machine_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot."""
    values = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle + iowait
    total = sum(values[:8])  # guest time is already in user
    return (total - idle) / TICK, total / TICK


@dataclasses.dataclass(frozen=True)
class Sample:
    own: float
    rabbitmq: float
    postgres: float
    busy: float
    total: float


def sample() -> Sample:
    times = os.times()
    busy, total = machine_seconds()
    return Sample(
        own=times.user + times.system,
        rabbitmq=sum(process_seconds(p) for p in pids_named("beam.smp")),
        postgres=sum(process_seconds(p, children=True) for p in pids_named("postgres")),
        busy=busy,
        total=total,
    )


def per_message(before: Sample, after: Sample, messages: int) -> dict[str, float]:
    """CPU microseconds per message of each, and the machine's busy share."""
    def us(field: str) -> float:
        spent: float = getattr(after, field) - getattr(before, field)
        return round(1e6 * spent / messages, 1)

    total = after.total - before.total
    return {
        "publisher_us": us("own"),
        "rabbitmq_us": us("rabbitmq"),
        "postgres_us": us("postgres"),
        "all_us": round(us("own") + us("rabbitmq") + us("postgres"), 1),
        "machine_busy": round((after.busy - before.busy) / total, 3) if total > 0 else 0.0,
    }


def rss_kib(pid: int) -> int | None:
    """``pid``'s resident memory (VmRSS, KiB); None if gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The machine's busy share between two :func:`machine_seconds` readings."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def wait_quiet(limit: float, below: float) -> float | None:
    """Wait up to ``limit`` seconds for the machine to be under ``below`` of all its cores
    busy (over 2 s); the last busy share measured (None: not measured)."""
    give_up = time.time() + limit
    busy = None
    while limit > 0:
        a = machine_seconds()
        time.sleep(2.0)
        busy = busy_share(a, machine_seconds())
        if busy is None or busy < below or time.time() >= give_up:
            break
    return busy
