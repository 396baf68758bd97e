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
import subprocess
import time
from pathlib import Path

TICK = float(os.sysconf("SC_CLK_TCK"))


def process_seconds(pid: int, *, children: bool = False) -> float:
    """User + system CPU seconds of ``pid`` (and its reaped children); 0 if gone."""
    stat = proc_stat(pid)
    if stat is None:
        return 0.0
    own, reaped, _ = stat
    return (own + (reaped if children else 0)) / TICK


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
    busy, idle = machine_ticks()
    return busy / TICK, (busy + idle) / TICK


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


# -- snapshots of the machine, the broker, Postgres and some processes, in clock ticks ------
# (bench_lanes: where each round's CPU went, as % of one core)

CLK_TCK = TICK
CORES = os.cpu_count() or 1


def proc_stat(pid: int) -> tuple[int, int, int] | None:
    """(utime+stime, cutime+cstime, ppid) of ``pid`` in clock ticks (None: gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields follow the last ')'.
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): utime is field 14, stime 15, cutime 16, cstime 17.
    return int(fields[11]) + int(fields[12]), int(fields[13]) + int(fields[14]), int(fields[1])


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) clock ticks over all cores since boot; iowait counts as idle."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    # user nice system idle iowait irq softirq steal (guest is inside user already)
    idle = fields[3] + fields[4]
    return sum(fields) - idle, idle


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return ""


def postgres_processes() -> dict[int, str]:
    """Every process named postgres, with its title (``postgres: 15/main: user db ...``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and read_text(f"/proc/{entry}/comm").strip() == "postgres":
            found[int(entry)] = read_text(f"/proc/{entry}/cmdline").replace("\0", " ").strip()
    return found


def broker_pids() -> list[int]:
    out = subprocess.run(["pgrep", "-f", "beam.smp"], capture_output=True, text=True,
                         check=False).stdout
    return [int(p) for p in out.split()]


@dataclasses.dataclass
class Snapshot:
    """Cumulative CPU clock ticks at one moment."""

    t: float
    busy: int
    idle: int
    broker: int
    postgres: int
    #: utime+stime of each live postgres process whose title names the round's database
    ours: dict[int, int]
    #: utime+stime of each live drain process
    drains: dict[int, int]


class Sampler:
    """Takes Snapshots of the machine, the broker, Postgres and the drain processes."""

    def __init__(self, database: str) -> None:
        self.database = database
        self.broker = broker_pids()
        self.drain_pids: list[int] = []

    def take(self) -> Snapshot:
        t = time.perf_counter()
        busy, idle = machine_ticks()
        broker = 0
        for pid in self.broker:
            stat = proc_stat(pid)
            broker += stat[0] if stat else 0
        postgres = 0
        ours = {}
        processes = postgres_processes()
        for pid, title in processes.items():
            stat = proc_stat(pid)
            if stat is None:
                continue
            own, children, ppid = stat
            postgres += own
            if ppid not in processes:  # the postmaster: it reaps the backends that exit
                postgres += children
            if f" {self.database} " in f"{title} ":
                ours[pid] = own
        drains = {}
        for pid in self.drain_pids:
            stat = proc_stat(pid)
            if stat is not None:
                drains[pid] = stat[0]
        return Snapshot(t, busy, idle, broker, postgres, ours, drains)


def percent(ticks: float, seconds: float) -> float:
    """Clock ticks over ``seconds`` as % of one core."""
    return 100.0 * ticks / CLK_TCK / seconds if seconds > 0 else 0.0


def ours_ticks(snapshots: list[Snapshot]) -> int:
    """CPU of this database's backends over the snapshots: each pid's last value less its
    first (0 for a pid already there at the start; a pid that appeared counts from 0)."""
    first = snapshots[0].ours
    last: dict[int, int] = {}
    for s in snapshots:
        last.update(s.ours)
    return sum(v - first.get(pid, 0) for pid, v in last.items())


def interval_cpu(a: Snapshot, b: Snapshot) -> dict[str, float]:
    """CPU use between two snapshots, in % of one core."""
    seconds = b.t - a.t
    total = (b.busy - a.busy) + (b.idle - a.idle)
    # /proc/stat and the clock disagree a little: scale idle to the cores x 100 % cap.
    idle = 100.0 * CORES * (b.idle - a.idle) / total if total else 0.0
    drains = sum(v - a.drains.get(pid, 0) for pid, v in b.drains.items())
    return {
        "seconds": round(seconds, 3),
        "busy": round(100.0 * CORES - idle, 1),
        "idle": round(idle, 1),
        "drains": round(percent(drains, seconds), 1),
        "broker": round(percent(b.broker - a.broker, seconds), 1),
        "postgres": round(percent(b.postgres - a.postgres, seconds), 1),
    }
