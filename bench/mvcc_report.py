"""bench_mvcc's figures: each phase's fetch times and backlog, the verdict, the plot."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from typing import Any

#: The goal's figures: hold this long, stay within this factor of the baseline.
GOAL_HOLD = 600.0
GOAL_RATIO = 2.0
#: The hold's last this many seconds are compared with the baseline.
LAST_WINDOW = 60.0
#: The baseline's first seconds (connections warming up) are not in its statistics.
WARMUP = 5.0
#: An open writing transaction older than this is reported (it holds keyset marks back).
LONG_WRITER = 2.0
BACKLOG_EVERY = 0.25
COLORS = {"head": "tab:red", "keyset": "tab:blue"}


@dataclasses.dataclass
class Run:
    """What one strategy's run recorded; times are seconds since the stager started."""

    strategy: str
    baseline: float
    hold: float
    after: float
    #: (t, fetch seconds, rows) per fetch, appended by the drain thread.
    fetches: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    #: (t, expire query seconds, rows moved) per expire query (drain thread).
    expires: list[tuple[float, float, int]] = dataclasses.field(default_factory=list)
    #: (t, jobs committed, jobs confirmed)
    backlog: list[tuple[float, int, int]] = dataclasses.field(default_factory=list)
    #: (t, n_dead_tup, n_live_tup, ready index bytes, holder holds a snapshot)
    dead: list[tuple[float, int, int, int, bool]] = dataclasses.field(default_factory=list)
    #: (t, seconds, database) of the oldest open transaction with a transaction id
    #: anywhere in the cluster (the drain's and stagers' own included; they are short)
    writers: list[tuple[float, float, str]] = dataclasses.field(default_factory=list)
    commits: int = 0
    committed: int = 0
    confirmed: int = 0
    hold_started: float = 0.0
    hold_ended: float = 0.0
    ended: float = 0.0



def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def fetch_stats(run: Run, lo: float, hi: float, *, expires: bool = False) -> dict[str, Any]:
    window = [(s, n) for t, s, n in (run.expires if expires else run.fetches) if lo <= t < hi]
    ms = [s * 1000 for s, _ in window]
    rows = [n for _, n in window if n]
    return {
        "from_s": round(lo, 1), "to_s": round(hi, 1), "fetches": len(ms),
        "p50_ms": pct(ms, 0.5), "p95_ms": pct(ms, 0.95),
        "max_ms": round(max(ms), 3) if ms else None,
        "rows_per_fetch": round(statistics.mean(rows), 1) if rows else 0,
    }


def backlog_max(run: Run, lo: float, hi: float) -> int:
    return max((c - d for t, c, d in run.backlog if lo <= t < hi), default=0)


def summarize(run: Run, batch_size: int) -> dict[str, Any]:
    h0, h1, end = run.hold_started, run.hold_ended, run.ended
    window = min(LAST_WINDOW, h1 - h0)
    bounds = {"baseline": (min(WARMUP, h0 / 2), h0), "hold": (h0, h1),
              "hold_last": (h1 - window, h1), "after": (h1, end)}
    phases = {}
    for name, (lo, hi) in bounds.items():
        phases[name] = fetch_stats(run, lo, hi)
        phases[name]["backlog_max"] = backlog_max(run, lo, hi)
    ratio_p50 = ratio(phases["hold_last"]["p50_ms"], phases["baseline"]["p50_ms"])
    expire_phases = {name: fetch_stats(run, lo, hi, expires=True)
                     for name, (lo, hi) in bounds.items()}
    worst = backlog_max(run, 0.0, end)
    held = [snap for t, *_, snap in run.dead if h0 < t < h1]
    dead_max = max((d for _, d, *_ in run.dead), default=0)
    index_max = max((size for _, _, _, size, _ in run.dead), default=0)
    oldest = max(run.writers, key=lambda w: w[1], default=(0.0, 0.0, ""))
    stalled = sum(BACKLOG_EVERY for _, age, _ in run.writers if age > LONG_WRITER)
    return {
        "strategy": run.strategy,
        "phases": phases,
        "ratio_p50": ratio_p50,
        "expire": expire_phases,
        "expire_ratio_p50": ratio(expire_phases["hold_last"]["p50_ms"],
                                  expire_phases["baseline"]["p50_ms"]),
        "ratio_p95": ratio(phases["hold_last"]["p95_ms"], phases["baseline"]["p95_ms"]),
        "backlog_max": worst,
        "backlog_limit": 2 * batch_size,
        "dead_tuples_max": dead_max,
        "ready_index_mb_max": round(index_max / 2**20, 1),
        "longest_writer": {"seconds": round(oldest[1], 1), "database": oldest[2],
                           "at_s": round(oldest[0], 1)},
        "seconds_with_writer_over_2s": round(stalled, 1),
        "snapshot_held": bool(held) and all(held),
        "committed": run.committed,
        "confirmed": run.confirmed,
        "stager_rate": round(run.committed / end, 1) if end else 0.0,
        "commits": run.commits,
        "rows_per_commit": round(run.committed / run.commits, 2) if run.commits else None,
        "within_ratio": ratio_p50 is not None and ratio_p50 <= GOAL_RATIO,
        "within_backlog": worst < 2 * batch_size,
    }


def series(run: Run, bin_seconds: float = 2.0) -> dict[str, Any]:
    """Compact time series for the JSON (per-bin fetch medians, sampled backlog)."""
    bins: dict[int, list[float]] = {}
    for t, s, _ in run.fetches:
        if t >= 0:
            bins.setdefault(int(t // bin_seconds), []).append(s * 1000)
    step = max(1, round(1.0 / BACKLOG_EVERY))
    return {
        "fetch_p50_ms": [[round(k * bin_seconds, 1), round(statistics.median(v), 3)]
                         for k, v in sorted(bins.items())],
        "backlog": [[round(t, 2), c - d] for t, c, d in run.backlog[::step]],
        "dead_tuples": [[round(t, 1), d] for t, d, *_ in run.dead],
    }


def rolling_median(points: list[tuple[float, float]], bin_seconds: float
                   ) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for t, v in points:
        bins.setdefault(int(t // bin_seconds), []).append(v)
    keys = sorted(bins)
    return [(k + 0.5) * bin_seconds for k in keys], [statistics.median(bins[k]) for k in keys]


def plot(runs: list[Run], args: argparse.Namespace, paths: list[str]) -> bool:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)", file=sys.stderr)
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_fetch, ax_backlog) = plt.subplots(2, 1, sharex=True, figsize=(11, 7.5),
                                               height_ratios=(3, 2))
    ax_dead = ax_fetch.twinx()
    first = runs[0]
    span = max(run.ended for run in runs)
    bin_seconds = max(1.0, span / 300)
    for ax in (ax_fetch, ax_backlog):
        ax.axvspan(first.hold_started, first.hold_ended, color="0.85", zorder=0,
                   label="snapshot held open" if ax is ax_fetch else None)
    for run in runs:
        color = COLORS.get(run.strategy, "tab:green")
        points = [(t, s * 1000) for t, s, _ in run.fetches if t >= 0]
        stride = max(1, len(points) // 20000)
        sample = points[::stride]
        ax_fetch.scatter([t for t, _ in sample], [v for _, v in sample], s=2, alpha=0.12,
                         color=color, linewidths=0, rasterized=True)
        xs, ys = rolling_median(points, bin_seconds)
        ax_fetch.plot(xs, ys, color=color, linewidth=1.8,
                      label=f"{run.strategy}: fetch per batch (median per {bin_seconds:.1f} s)")
        ax_dead.plot([t for t, *_ in run.dead], [d for _, d, *_ in run.dead], color=color,
                     linestyle=":", linewidth=1.2, label=f"{run.strategy}: dead tuples")
        ax_backlog.plot([t for t, _, _ in run.backlog], [c - d for _, c, d in run.backlog],
                        color=color, linewidth=1.0, label=f"{run.strategy}: backlog")
    ax_backlog.axhline(2 * args.batch_size, color="black", linestyle="--", linewidth=1,
                       label=f"two batches ({2 * args.batch_size:,} jobs)")
    ax_fetch.set_yscale("log")
    ax_fetch.set_ylabel("fetch time per batch (ms, log)")
    ax_dead.set_ylabel("n_dead_tup (staged_jobs)")
    ax_dead.set_ylim(bottom=0)
    ax_backlog.set_ylabel("backlog (jobs committed - confirmed)")
    ax_backlog.set_ylim(bottom=0)
    ax_backlog.set_xlabel("seconds")
    handles, labels = ax_fetch.get_legend_handles_labels()
    more_handles, more_labels = ax_dead.get_legend_handles_labels()
    ax_fetch.legend(handles + more_handles, labels + more_labels, loc="upper left",
                    fontsize=8)
    ax_backlog.legend(loc="upper left", fontsize=8)
    held = first.hold_ended - first.hold_started
    ax_fetch.set_title(
        f"drain fetch under a long transaction: {args.rate:g} jobs/s staged, batch "
        f"{args.batch_size}, REPEATABLE READ snapshot held {held:.0f} s", fontsize=10)
    fig.tight_layout()
    for path in paths:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def verdict(results: dict[str, dict[str, Any]], hold: float) -> tuple[str, bool | None]:
    keyset = results.get("keyset")
    parts = []
    for name, r in results.items():
        p = r["phases"]
        parts.append(
            f"{name}: fetch p50 {fmt(p['baseline']['p50_ms'])} ms -> "
            f"{fmt(p['hold_last']['p50_ms'])} ms in the hold's last minute "
            f"({fmt(r['ratio_p50'])}x), backlog max {r['backlog_max']:,}"
        )
    text = f"{hold:.0f} s hold; " + "; ".join(parts)
    if keyset is None:
        return text, None
    ok = keyset["within_ratio"] and keyset["within_backlog"] and keyset["snapshot_held"]
    if not ok:
        return text, False
    # The hold is measured between two sampler ticks: 599.9 s is a 10-minute hold.
    return text, True if hold >= GOAL_HOLD - 1.0 else None


def with_expire(args: argparse.Namespace, goal: str, measured: str,
                results: dict[str, Any]) -> tuple[str, str]:
    """With --mix, the summary row names the expire query's ratio too."""
    if not args.mix:
        return goal, measured
    return (goal + "; with delayed and expiring jobs (--mix), the expire query's too",
            measured + "; expire query " + ", ".join(
                f"{fmt(r['expire_ratio_p50'])}x" for r in results.values()))


def result_name(args: argparse.Namespace) -> str:
    """bench/results/<this>.json and .png: a smoke run and a --mix run keep their own."""
    return ("mvcc-mix" if args.mix else "mvcc") + ("-smoke" if args.smoke else "")


def print_expire(r: dict[str, Any]) -> None:
    """The expire query's times, when it ran (with --mix it finds rows to move)."""
    e = r["expire"]
    if e["baseline"]["fetches"]:
        print(f"  expire query p50: baseline {fmt(e['baseline']['p50_ms'])} ms, hold's last "
              f"minute {fmt(e['hold_last']['p50_ms'])} ms ({fmt(r['expire_ratio_p50'])}x), "
              f"p95 {fmt(e['baseline']['p95_ms'])} -> {fmt(e['hold_last']['p95_ms'])} ms; "
              f"{e['hold_last']['fetches']} queries in the last minute")


