"""bench_lanes' rounds, and what they show: the rate per lane count, where the CPU
went, where scaling stops and why, printed and written to bench/results/lanes.json."""

from __future__ import annotations

import argparse
import dataclasses
import itertools

import harness
from cpu import CORES

GOAL_JOBS = 200_000
#: Below this many % of one core idle (over all cores), the machine counts as saturated.
SATURATED_IDLE = 15.0
#: A baseline under this many % of one core busy counts as a quiet machine (--wait-quiet).
QUIET_BUSY = 20.0
#: A lane count that adds less than this to the rate of the one before has stopped scaling.
SCALING_GAIN = 1.10


@dataclasses.dataclass
class Round:
    lanes: int
    jobs: int
    #: the jobs name this many queues, round-robin (1: all the same queue, as in the target)
    queues: int = 1
    stage_seconds: float = 0.0
    seconds: float = 0.0
    first_message_seconds: float | None = None
    exit_codes: list[int] = dataclasses.field(default_factory=list)
    #: CPU seconds (user+system) of each drain process, from wait4's rusage
    drain_cpu_seconds: list[float] = dataclasses.field(default_factory=list)
    drain_wall_seconds: list[float] = dataclasses.field(default_factory=list)
    queued: int = 0
    staged_left: int = -1
    dead: int = -1
    baseline: dict[str, float] = dataclasses.field(default_factory=dict)
    cpu: dict[str, float] = dataclasses.field(default_factory=dict)
    #: each drain's CPU % over the round
    per_drain: list[float] = dataclasses.field(default_factory=list)
    timeline: list[dict[str, float]] = dataclasses.field(default_factory=list)
    #: the broker's ceiling with N publishers: "one queue" and "N queues" -> figures
    raw: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def label(self) -> str:
        lanes = f"{self.lanes} lane{'s' if self.lanes > 1 else ''}"
        return lanes if self.queues == 1 else f"{lanes}, {self.queues} queues"

    @property
    def rate(self) -> float:
        return self.jobs / self.seconds if self.seconds else 0.0

    @property
    def ok(self) -> bool:
        return (self.error is None and self.exit_codes == [0] * self.lanes
                and self.queued == self.jobs and self.staged_left == 0 and self.dead == 0)



def per_job_us(r: Round) -> dict[str, float]:
    """CPU microseconds per job, by component, over the round (start-up included)."""
    c, per = r.cpu, 1e6 * r.seconds / 100.0 / r.jobs  # % of one core -> us per job
    return {k: round(c[k] * per, 1) for k in ("drains", "broker", "postgres",
                                                "postgres_this_database", "other")}


def ceiling(r: Round) -> float:
    """The rate all cores would give if the drains, broker and Postgres had them to
    themselves at this round's CPU cost per job."""
    us = per_job_us(r)
    total = us["drains"] + us["broker"] + us["postgres"]
    return CORES * 1e6 / total if total else 0.0


def steady_rate(r: Round) -> float:
    """Jobs per second from the first message in the queue to the last drain's exit."""
    if r.first_message_seconds is None or r.seconds <= r.first_message_seconds:
        return 0.0
    return r.jobs / (r.seconds - r.first_message_seconds)


def broker_evidence(r: Round, spread: Round | None) -> tuple[str, bool]:
    """What the raw publishers and the spread round say at ``r``'s lane count, and whether
    they show the one queue as the ceiling: the drains reach >= 80 % of what N raw
    publishers get into one queue, and N queues take >= 25 % more."""
    one, many = r.raw.get("one queue"), r.raw.get("N queues")
    if one is None:
        return "", False
    text = f"raw pika x{r.lanes}: {one['jobs_per_second'] / 1000:.1f}k/s into one queue"
    wider = False
    if many:
        text += f", {many['jobs_per_second'] / 1000:.1f}k/s into {r.lanes}"
        wider = many["jobs_per_second"] >= 1.25 * one["jobs_per_second"]
    if spread is not None and spread.ok:
        text += f"; {r.lanes} lanes over {r.lanes} queues {spread.rate / 1000:.1f}k/s"
        wider = wider or spread.rate >= 1.25 * r.rate
    capped = wider and steady_rate(r) >= 0.8 * one["jobs_per_second"]
    return text, capped


def reason(rounds: list[Round]) -> tuple[str, str]:
    """Where the rate stops growing and what limits it there: a short line for the
    summary and a long one with the CPU split and the evidence."""
    cap = 100 * CORES
    done = [r for r in rounds if r.ok and r.queues == 1]
    if len(done) < 2:
        return ("too few complete rounds to say",) * 2
    stop_at = next((r for prev, r in itertools.pairwise(done)
                    if r.rate < SCALING_GAIN * prev.rate), None)
    r = stop_at or done[-1]
    c = r.cpu
    split = (f"drains {c['drains']:.0f} %, broker {c['broker']:.0f} %, "
             f"postgres {c['postgres']:.0f} %, other {c['other']:.0f} %, "
             f"idle {c['idle']:.0f} % of {cap} %")
    biggest = max(("the drains", c["drains"]), ("the broker", c["broker"]),
                  ("postgres", c["postgres"]), ("other load (not this bench)", c["other"]),
                  key=lambda kv: kv[1])[0]
    where = (f"stops scaling at {r.lanes} lanes" if stop_at
             else f"still scaling at {r.lanes} lanes")
    spread = next((x for x in rounds if x.lanes == r.lanes and x.queues > 1), None)
    evidence, capped = broker_evidence(r, spread)
    if c["idle"] < SATURATED_IDLE:
        why = f"CPU-bound: {CORES} cores saturated, {biggest} the largest share"
    elif capped:
        why = ("the one queue all lanes publish to is the ceiling (a classic queue is one "
               "Erlang process), with CPU to spare")
    else:
        why = "CPU left idle: waits (round trips, confirms, fsync), not cores"
    after = ""
    if spread is not None and spread.ok and spread.cpu["idle"] < SATURATED_IDLE:
        after = (f"; over {spread.queues} queues the cores saturate "
                 f"{'too' if c['idle'] < SATURATED_IDLE else 'instead'} "
                 f"(idle {spread.cpu['idle']:.0f} %)")
    busy_before = max((x.baseline.get("busy", 0.0) for x in done), default=0.0)
    other = max(x.cpu["other"] for x in done)
    noisy = max(busy_before, other) > QUIET_BUSY
    evidence = f"; {evidence}" if evidence else ""
    short = f"{where}: {why}{evidence}{after}{'; NOT a quiet machine' if noisy else ''}"
    noise = (f"; NOT a quiet machine: up to {busy_before:.0f} % busy before a round, "
             f"up to {other:.0f} % other load during one" if noisy else "")
    return short, f"{where}: {why} ({split}){evidence}{after}{noise}"


def base_rate(rounds: list[Round]) -> float | None:
    return next((r.rate for r in rounds if r.lanes == 1 and r.queues == 1 and r.ok), None)


def print_table(rounds: list[Round], jobs: int) -> None:
    base = base_rate(rounds)
    cap = 100 * CORES
    w = max(len("lanes"), *(len(r.label) for r in rounds))
    print(f"\nlanes: {jobs:,} jobs, {CORES} cores (CPU in % of one core, {cap} % in all), "
          "N `drain run --exit-when-empty --lanes N --lane K` started at once, timed to the "
          "last exit\n")
    print(f"| {'lanes':<{w}} | seconds | jobs/s | x 1 lane | drain CPU % (per lane) | "
          "broker CPU % | postgres CPU % (this db) | other % | idle % | ok |")
    print(f"|{'-' * (w + 2)}|---:|---:|---:|---|---:|---:|---:|---:|---|")
    for r in rounds:
        c = r.cpu
        if not c:
            print(f"| {r.label:<{w}} | - | - | - | - | - | - | - | - | **no**: {r.error} |")
            continue
        x = f"{r.rate / base:.2f}" if base else "-"
        per = "+".join(f"{p:.0f}" for p in r.per_drain)
        print(f"| {r.label:<{w}} | {r.seconds:.2f} | {r.rate:,.0f} | {x} | "
              f"{c['drains']:.0f} ({per}) | {c['broker']:.0f} | "
              f"{c['postgres']:.0f} ({c['postgres_this_database']:.0f}) | {c['other']:.0f} | "
              f"{c['idle']:.0f} | {'yes' if r.ok else '**no**: ' + str(r.error)} |")
    print_notes(rounds)


def print_notes(rounds: list[Round]) -> None:
    """CPU per job, start-up, the raw publishers, the baselines."""
    measured = [r for r in rounds if r.cpu]
    if measured:
        print("\nCPU per job in us (start-up included), and the rate all cores would give the "
              "drains, broker and Postgres at that cost:")
    for r in measured:
        us = per_job_us(r)
        print(f"  {r.label}: drains {us['drains']:.0f}, broker {us['broker']:.0f}, "
              f"postgres {us['postgres']:.0f} (this db {us['postgres_this_database']:.0f}), "
              f"other {us['other']:.0f} -> ceiling {ceiling(r):,.0f} jobs/s")
    started = [r for r in rounds if r.first_message_seconds is not None and r.ok]
    if started:
        print("start-up (first message in a queue, to the interval) and the rate after it:")
    for r in started:
        print(f"  {r.label}: {r.first_message_seconds:.2f} s, then {steady_rate(r):,.0f} jobs/s")
    if any(r.raw for r in rounds):
        print("\nthe broker's ceiling: N raw pika publishers at once, each pipelining 1000 "
              "confirms with the drain's encoded properties, first publish to last confirm "
              "(CPU %: broker, idle, other):\n")
        print("| lanes | drain jobs/s after start-up | raw xN into one queue | "
              "raw xN into N queues |")
        print("|---:|---:|---|---|")
        for r in rounds:
            if r.queues != 1:
                continue
            cells = []
            for name in ("one queue", "N queues"):
                raw = r.raw.get(name)
                cells.append(f"{raw['jobs_per_second']:,.0f}/s ({raw['broker_cpu']:.0f}, "
                             f"{raw['idle']:.0f}, {raw['other']:.0f})" if raw else "-")
            print(f"| {r.lanes} | {steady_rate(r):,.0f} | {' | '.join(cells)} |")
    with_baseline = [r for r in rounds if r.baseline]
    if with_baseline:
        print("\nbefore each round (baseline: other load on the machine):")
    for r in with_baseline:
        b = r.baseline
        print(f"  {r.label}: machine busy {b['busy']:.0f} %, broker "
              f"{b['broker']:.0f} %, postgres {b['postgres']:.0f} % over {b['seconds']} s")


def write(rounds: list[Round], args: argparse.Namespace, short: str, why: str,
          broker_before: dict[str, float] | None) -> None:
    base = base_rate(rounds)
    parts = []
    for r in rounds:
        if r.queues != 1:
            continue
        if not r.ok:
            parts.append(f"{r.lanes}: failed")
        elif r.lanes == 1 or base is None:
            parts.append(f"{r.lanes}: {r.rate:,.0f}/s")
        else:
            parts.append(f"{r.lanes}: {r.rate:,.0f}/s ({r.rate / base:.2f}x)")
    size = "" if args.jobs >= GOAL_JOBS else f" [{args.jobs:,} jobs, not the goal's {GOAL_JOBS:,}]"
    harness.write_results("lanes", [harness.row(
        "5. Scale-out lanes", "throughput for 1, 2, 4 lanes; say where it stops scaling and why",
        f"{', '.join(parts)}; {short}{size}", None)], smoke=args.smoke, details={
            "reason": why,
            "jobs": args.jobs, "batch_size": args.batch_size, "cores": CORES,
            "cpu_unit": f"% of one core ({100 * CORES} % = all cores)",
            "interval": args.interval, "broker_memory_before": broker_before,
            "rounds": [{
                "lanes": r.lanes, "queues": r.queues, "ok": r.ok, "error": r.error,
                "seconds": round(r.seconds, 3), "jobs_per_second": round(r.rate),
                "x_1_lane": round(r.rate / base, 3) if base and r.ok else None,
                "first_message_seconds": r.first_message_seconds,
                "jobs_per_second_after_first_message": round(steady_rate(r)) if r.ok else None,
                "cpu_us_per_job": per_job_us(r) if r.cpu else None,
                "ceiling_jobs_per_second": round(ceiling(r)) if r.cpu else None,
                "stage_seconds": round(r.stage_seconds, 2),
                "exit_codes": r.exit_codes, "queued": r.queued,
                "staged_left": r.staged_left, "dead": r.dead,
                "drain_cpu_seconds": [round(c, 3) for c in r.drain_cpu_seconds],
                "drain_wall_seconds": [round(w, 3) for w in r.drain_wall_seconds],
                "cpu": {**r.cpu, "per_drain": r.per_drain},
                "raw_publishers": r.raw,
                "baseline": r.baseline, "timeline": r.timeline,
            } for r in rounds],
        })
