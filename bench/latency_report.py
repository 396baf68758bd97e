"""bench_latency's figures: per-job timelines from the probe's records, the
distributions of one rate, and how they are printed and summarised."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import math
import os
from typing import Any

from harness import percentile

P50_GOAL_MS = 5.0
P99_GOAL_MS = 50.0

#: (task_id, seq, due, t_begin, t_committed), one per staged job.
StagedRecord = tuple[str, int, float, float, float]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One rate's open-loop schedule: job ``seq`` is due at ``t0 + seq / rate``."""

    url: str
    queue: str
    rate: float
    t0: float
    jobs: int
    stagers: int

    @property
    def phase(self) -> str:
        return f"r{self.rate:g}"


@dataclasses.dataclass
class Phase:
    schedule: Schedule
    warmup: float
    duration: float
    records: list[StagedRecord]
    drain_cpu: float | None
    machine_busy: float | None
    #: The machine's busy fraction just before the stagers started (--wait-quiet).
    busy_before: float | None = None
    #: The drain's resident memory (KiB) at the start and end of the measured window.
    rss: tuple[int | None, int | None] = (None, None)


# -- statistics --------------------------------------------------------------------------


def distribution(values_ms: list[float]) -> dict[str, Any]:
    v = sorted(values_ms)
    if not v:
        return {"count": 0}
    return {
        "count": len(v),
        "min": v[0],
        "p50": percentile(v, 50),
        "p90": percentile(v, 90),
        "p99": percentile(v, 99),
        "p99.9": percentile(v, 99.9),
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def quantiles(values: list[float]) -> dict[str, float]:
    v = sorted(values)
    return {"p50": percentile(v, 50), "p99": percentile(v, 99),
            "max": v[-1] if v else math.nan}


BUCKETS_MS = (0.5, 1, 2, 3, 5, 10, 20, 50, 100, 200, 500, 1000)


def histogram(values_ms: list[float]) -> list[tuple[str, int]]:
    """Counts per bucket of BUCKETS_MS, empty buckets at both ends left out."""
    counts = [0] * (len(BUCKETS_MS) + 1)
    for x in values_ms:
        counts[sum(1 for edge in BUCKETS_MS if x >= edge)] += 1
    labels = [f"< {BUCKETS_MS[0]:g}"]
    labels += [f"{a:g}-{b:g}" for a, b in itertools.pairwise(BUCKETS_MS)]
    labels += [f">= {BUCKETS_MS[-1]:g}"]
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return []
    return [(labels[i], counts[i]) for i in range(used[0], used[-1] + 1)]


def print_histogram(rows: list[tuple[str, int]], width: int = 50) -> None:
    if not rows:
        return
    top = max(c for _, c in rows)
    total = sum(c for _, c in rows)
    for label, c in rows:
        bar = "#" * max(1 if c else 0, round(width * c / top))
        print(f"    {label:>10} ms | {c:>6} {100 * c / total:5.1f}% {bar}")


def fmt(d: dict[str, Any]) -> str:
    if not d.get("count"):
        return "no samples"
    return (f"n={d['count']}  p50 {d['p50']:.2f}  p90 {d['p90']:.2f}  p99 {d['p99']:.2f}  "
            f"p99.9 {d['p99.9']:.2f}  max {d['max']:.2f}  (min {d['min']:.2f}) ms")


def verdict(d: dict[str, Any]) -> bool | None:
    if not d.get("count"):
        return None
    return bool(d["p50"] <= P50_GOAL_MS and d["p99"] <= P99_GOAL_MS)



# -- the probe's records -> per-job timelines ------------------------------------------


def confirm_times(probe: dict[str, Any]) -> dict[int, dict[int, tuple[float, bool]]]:
    """generation -> delivery tag -> (time the drain handled its ack/nack, acked)."""
    frames: dict[int, list[tuple[float, int, bool, bool]]] = collections.defaultdict(list)
    for t, gen, tag, multiple, ack in probe["confirm"]:
        frames[gen].append((t, tag, multiple, ack))
    out: dict[int, dict[int, tuple[float, bool]]] = {}
    for gen, fs in frames.items():
        resolved: dict[int, tuple[float, bool]] = {}
        low = 1
        for t, tag, multiple, ack in fs:
            # A 'multiple' ack covers every tag up to its own not resolved yet.
            for k in range(low if multiple else tag, tag + 1):
                resolved.setdefault(k, (t, ack))
            if multiple:
                low = max(low, tag + 1)
        out[gen] = resolved
    return out


def probe_timelines(probe: dict[str, Any]) -> dict[str, dict[str, float]]:
    """task_id -> first fetch_start, fetched, published, confirmed, deleted times."""
    out: dict[str, dict[str, float]] = collections.defaultdict(dict)
    row_task: dict[int, str] = {}
    for t0, t1, rows in probe["fetch"]:
        for row_id, task_id in rows:
            row_task[row_id] = task_id
            out[task_id].setdefault("fetch_start", t0)
            out[task_id].setdefault("fetched", t1)
    confirmed = confirm_times(probe)
    for _t0, t1, gen, base, task_ids in probe["publish"]:
        acks = confirmed.get(gen, {})
        for i, task_id in enumerate(task_ids):
            job = out[task_id]
            job.setdefault("published", t1)
            hit = acks.get(base + i + 1)
            if hit is not None and hit[1]:
                job.setdefault("confirmed", hit[0])
    for _t0, t1, deleted in probe["tx"]:
        for row_id in deleted:
            if row_id in row_task:
                out[row_task[row_id]].setdefault("deleted", t1)
    return dict(out)


def probe_loop(probe: dict[str, Any], start: float, end: float) -> dict[str, Any]:
    """What the drain's loop did between start and end: batch sizes, waits, wake-ups."""
    def within(key: str) -> list[Any]:
        return [r for r in probe[key] if start <= r[0] < end]

    fetched = [len(rows) for _t0, _t1, rows in within("fetch")]
    queries: dict[str, list[float]] = collections.defaultdict(list)
    for t0, t1, name in within("query"):
        queries[name].append(1000 * (t1 - t0))
    idles = within("idle")
    return {
        "transactions": len(within("tx")),
        "fetches": len(fetched),
        "empty_fetches": sum(1 for n in fetched if n == 0),
        "rows_per_nonempty_fetch": quantiles([n for n in fetched if n]),
        "transaction_ms": quantiles([1000 * (t1 - t0) for t0, t1, _ in within("tx")]),
        "confirm_wait_ms": quantiles([1000 * (t1 - t0) for t0, t1, _ in within("wait")]),
        "idle_waits": len(idles),
        "idle_waits_ended_by_notify": sum(1 for i in idles if i[2]),
        "idle_wait_ms": quantiles([1000 * (i[1] - i[0]) for i in idles]),
        # NOTIFYs already waiting (received during other queries) at each idle wait.
        "notifies_queued_at_idle": quantiles([i[3] for i in idles if len(i) > 3]),
        "queries_ms": {
            name: {"count": len(times), **quantiles(times)}
            for name, times in sorted(queries.items())
        },
    }



def analyse(phase: Phase, delivered: dict[str, list[float]] | None,
            timelines: dict[str, dict[str, float]] | None) -> dict[str, Any]:
    """The figures of one rate; keys starting with '_' are raw values, not saved."""
    records = phase.records
    measured = [r for r in records if r[2] >= phase.schedule.t0 + phase.warmup]
    commits = [r[4] for r in measured]
    span = (max(commits) - min(commits)) if len(commits) > 1 else 0.0
    result: dict[str, Any] = {
        "rate_offered": phase.schedule.rate,
        "stagers": phase.schedule.stagers,
        "committed_total": len(records),
        "measured_jobs": len(measured),
        "rate_achieved": (len(commits) - 1) / span if span > 0 else math.nan,
        "schedule_lag_ms": quantiles([1000 * (r[3] - r[2]) for r in measured]),
        "stager_insert_commit_ms": quantiles([1000 * (r[4] - r[3]) for r in measured]),
        "drain_cpu_fraction": phase.drain_cpu,
        "machine_cpu_busy_fraction": phase.machine_busy,
        "machine_cpu_busy_before_fraction": phase.busy_before,
        "drain_rss_kib": {"start": phase.rss[0], "end": phase.rss[1]},
    }
    missing: set[str] = set()
    if delivered is not None:
        lat = [1000 * (delivered[r[0]][0] - r[4]) for r in measured if r[0] in delivered]
        result["commit_to_delivery_ms"] = distribution(lat)
        result["commit_to_delivery_histogram"] = histogram(lat)
        undelivered = {r[0] for r in records if r[0] not in delivered}
        result["not_delivered"] = len(undelivered)
        missing |= undelivered
        result["duplicates_delivered"] = sum(
            len(delivered[r[0]]) - 1 for r in records if r[0] in delivered)
    if timelines is not None:
        def span_ms(a: str, b: str) -> list[float]:
            out = []
            for r in measured:
                job = timelines.get(r[0], {})
                begin = r[4] if a == "commit" else job.get(a)
                end = job.get(b)
                if begin is not None and end is not None:
                    out.append(1000 * (end - begin))
            return out

        confirm = span_ms("commit", "confirmed")
        result["commit_to_confirm_ms"] = distribution(confirm)
        result["commit_to_confirm_histogram"] = histogram(confirm)
        unconfirmed = {r[0] for r in records if "confirmed" not in timelines.get(r[0], {})}
        result["not_confirmed"] = len(unconfirmed)
        missing |= unconfirmed
        result["breakdown_ms"] = {
            "commit -> fetch starts": distribution(span_ms("commit", "fetch_start")),
            "fetch (query)": distribution(span_ms("fetch_start", "fetched")),
            "fetched -> handed to pika": distribution(span_ms("fetched", "published")),
            "handed to pika -> confirm seen": distribution(span_ms("published", "confirmed")),
            "confirm -> row deleted (committed)": distribution(span_ms("confirmed", "deleted")),
            "commit -> row deleted (committed)": distribution(span_ms("commit", "deleted")),
        }
    # Committed jobs that were not confirmed (probe) or not delivered (consumer).
    result["lost"] = len(missing)
    return result



def report(r: dict[str, Any], left_staged: int) -> None:
    lag, commit = r["schedule_lag_ms"], r["stager_insert_commit_ms"]
    print(f"\n== {r['rate_offered']:g} jobs/s offered, {r['stagers']} stager(s): achieved "
          f"{r['rate_achieved']:.1f} jobs/s over {r['measured_jobs']} measured jobs "
          f"({r['committed_total']} committed with the warm-up)")
    print(f"   stagers: schedule lag p50 {lag['p50']:.2f} ms, p99 {lag['p99']:.2f} ms, max "
          f"{lag['max']:.1f} ms; INSERT+COMMIT p50 {commit['p50']:.2f} ms, p99 "
          f"{commit['p99']:.2f} ms")
    cpu, busy = r["drain_cpu_fraction"], r["machine_cpu_busy_fraction"]
    if cpu is not None and busy is not None:
        before = r.get("machine_cpu_busy_before_fraction")
        print(f"   drain process CPU {100 * cpu:.0f}% of one core; whole machine "
              f"{100 * busy:.0f}% busy ({os.cpu_count()} cores)"
              + (f", {100 * before:.0f}% just before" if before is not None else ""))
    rss = r["drain_rss_kib"]
    if rss["start"] is not None and rss["end"] is not None:
        print(f"   drain resident memory {rss['start'] / 1024:.1f} MiB -> "
              f"{rss['end'] / 1024:.1f} MiB over the measured window"
              + (" (the probe's own records included)" if "drain_loop" in r else ""))
    for key, title in (("commit_to_confirm", "commit -> confirm (seen by the drain)"),
                       ("commit_to_delivery", "commit -> delivery to a consumer")):
        if f"{key}_ms" not in r:
            continue
        d = r[f"{key}_ms"]
        mark = {True: "MET", False: "NOT MET", None: "n/a"}[verdict(d)]
        print(f"   {title}: {fmt(d)}")
        print(f"     goal p50 <= {P50_GOAL_MS:g} ms and p99 <= {P99_GOAL_MS:g} ms: {mark}")
        print_histogram(r[f"{key}_histogram"])
    if "breakdown_ms" in r:
        print("   where the time goes (per job, ms):")
        for name, d in r["breakdown_ms"].items():
            if d.get("count"):
                print(f"     {name:<36} p50 {d['p50']:8.2f}  p90 {d['p90']:8.2f}  "
                      f"p99 {d['p99']:8.2f}  max {d['max']:8.2f}")
    if "drain_loop" in r:
        loop = r["drain_loop"]
        tx, cw, iw = loop["transaction_ms"], loop["confirm_wait_ms"], loop["idle_wait_ms"]
        print(f"   drain loop: {loop['transactions']} transactions, {loop['empty_fetches']} "
              f"of {loop['fetches']} fetches empty, rows per non-empty fetch p50 "
              f"{loop['rows_per_nonempty_fetch']['p50']:.0f} max "
              f"{loop['rows_per_nonempty_fetch']['max']:.0f}")
        print(f"     transaction p50 {tx['p50']:.2f} ms p99 {tx['p99']:.2f} ms; confirm wait "
              f"p50 {cw['p50']:.2f} ms p99 {cw['p99']:.2f} ms; {loop['idle_waits']} idle "
              f"waits ({loop['idle_waits_ended_by_notify']} ended by a NOTIFY), idle p50 "
              f"{iw['p50']:.2f} ms")
        per_tx = max(loop["transactions"], 1)
        print("     statements per transaction (round trip p50/p99 ms): " + ", ".join(
            f"{name} {q['count'] / per_tx:.2f} ({q['p50']:.2f}/{q['p99']:.2f})"
            for name, q in loop["queries_ms"].items()))
        queued = loop["notifies_queued_at_idle"]
        if queued["max"] == queued["max"]:  # not NaN
            print(f"     NOTIFYs waiting at an idle wait: p50 {queued['p50']:.0f}, "
                  f"max {queued['max']:.0f}")
    print(f"   lost = {r['lost']} (not confirmed {r.get('not_confirmed', 'n/a')}, not "
          f"delivered {r.get('not_delivered', 'n/a')}; staged rows left at the end of the "
          f"run {left_staged}); duplicate deliveries {r.get('duplicates_delivered', 'n/a')}")


def summary_row(r: dict[str, Any]) -> dict[str, Any] | None:
    key = "commit_to_confirm_ms" if "commit_to_confirm_ms" in r else "commit_to_delivery_ms"
    d = r.get(key, {})
    if not d.get("count"):
        return None
    what = "confirm" if "confirm" in key else "consumer delivery"
    return {
        "target": f"latency @ {r['rate_offered']:g}/s (commit -> {what})",
        "goal": f"p50 <= {P50_GOAL_MS:g} ms, p99 <= {P99_GOAL_MS:g} ms, lost 0",
        "measured": (f"p50 {d['p50']:.1f} ms, p99 {d['p99']:.1f} ms, max {d['max']:.0f} ms "
                     f"({d['count']} jobs at {r['rate_achieved']:.0f}/s, lost {r['lost']}, "
                     f"machine {100 * (r['machine_cpu_busy_fraction'] or 0):.0f}% busy)"),
        "met": bool(verdict(d)) and r["lost"] == 0,
    }


