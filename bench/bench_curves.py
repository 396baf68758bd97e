"""How the drain's cost grows with the work: curves, not points, each a ratio in one run.

    python bench/bench_curves.py [--curves backlog,queues,held,paused,refused,locked,dead,series]
                                 [--good 20000] [--<curve> 0,1000,...] [--smoke] [--docs-png]

Each point is a fresh database with a pile staged by SQL (bench/curves.py), then
``--good`` jobs for a queue that works, drained by an in-process drain:

* ``backlog``: the rate over the first ``--good`` jobs of a backlog of 20k, 1M, 10M
  staged rows (against the 20k one);
* ``queues``: ``--good`` jobs over 1, 2,000, 10,000 queues, against raw pika declaring
  the same queues (one round trip each) and publishing the same messages at the best
  of its confirm windows (bench/curves.py DEPTHS);
* ``held``: the good jobs' rate with 0 or 100,000 rows staged before them for a queue
  whose declare the broker refuses (406), without and with ``--app``
  (bench/curves_app.py routes rows staged without a queue: plain ``task_routes``,
  a router function that routes by name, and one that reads the arguments,
  reported apart);
* ``paused``: the good jobs' rate with 100,000 rows staged before them for a queue an
  operator paused (`drain pause`), without and with ``--app``, or for a paused task,
  against no pause and no pile: what a pause costs the rest (issue 39);
* ``refused``: with 0, 1 or 1,000 refused queues of 5 rows each;
* ``locked``: with 0 or 1,000 rows locked by an open ``SELECT ... FOR UPDATE``, and
  how often the locked jobs were delivered once the lock went;
* ``dead``: 0, 1M, 10M rows in dead_jobs: the status read, ``drain status``, a
  running drain's status page, /status.json and /metrics (best of 5 GETs), and
  ``drain dead list``'s read by each of its filters (the slowest, best of 3);
* ``series``: 10, 1,000, 10,000 task names and tags: the series in a /metrics scrape.

The goals (issue 36): the good jobs' rate with any pile >= 0.8 x without it; over many
queues >= 0.9 x raw pika; ``drain status`` <= 1 s and a scrape <= 0.5 s with 10M dead
jobs; a series count that does not grow with task names and tags. Prints a table per
curve, writes bench/results/curves.json (curves-smoke.json with ``--smoke``, tiny
sizes, no plot), bench/results/curves.png and, with ``--docs-png``, docs/curves.png.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import curves
import harness
from harness import free_port

from drain.daemon.metrics import MAX_GROUPS

GOAL_PILE = 0.8
GOAL_RAW = 0.9
GOAL_STATUS = 1.0
GOAL_SCRAPE = 0.5
DOCS_PNG = harness.ROOT / "docs" / "curves.png"

FULL = {"backlog": "20000,1000000,10000000", "queues": "1,2000,10000", "held": "0,100000",
        "paused": "0,100000",
        "refused": "0,1,1000", "locked": "0,1000", "dead": "0,1000000,10000000",
        "series": "10,1000,10000"}
SMOKE = {"backlog": "1000,5000", "queues": "1,20", "held": "0,2000", "paused": "0,2000",
         "refused": "0,20",
         "locked": "0,50", "dead": "0,5000", "series": "10,100"}


def measure(name: str, xs: list[int], good: int) -> dict[str, list[dict[str, Any]]]:
    """One curve's points (``held``: one line without ``--app`` and one with)."""
    point: dict[str, Callable[[int], dict[str, Any]]] = {
        "backlog": lambda x: curves.backlog(x, good),
        "queues": lambda x: curves.queues(x, good),
        "refused": lambda x: curves.refused(x, good),
        "locked": lambda x: curves.locked(x, good),
        "dead": lambda x: curves.dead(x, free_port()),
        "series": lambda x: curves.series(x, max(2 * x, 2000), free_port()),
    }
    point["paused"] = lambda x: curves.paused(x, good)
    point["paused --app"] = lambda x: curves.paused(x, good, app="app")
    point["paused (a task)"] = lambda x: curves.paused(x, good, kind="task")
    point["held"] = lambda x: curves.held(x, good)
    point["held --app"] = lambda x: curves.held(x, good, app="app")
    point["held --app, a router function"] = lambda x: curves.held(x, good, app="function")
    point["held --app, a router reading the arguments"] = (
        lambda x: curves.held(x, good, app="arguments"))
    variants = {"": name}
    if name == "held":
        variants = {"": "held", "--app": "held --app",
                    "--app, a router function": "held --app, a router function",
                    "--app, a router reading the arguments":
                        "held --app, a router reading the arguments"}
    elif name == "paused":
        variants = {"": "paused", "--app": "paused --app", "(a task)": "paused (a task)"}
    return {variant: [_point(key, x, point[key]) for x in xs] for variant, key in variants.items()}


def _point(name: str, x: int, run: Callable[[int], dict[str, Any]]) -> dict[str, Any]:
    """One point; one that does not finish within curves.TIMEOUT is recorded as such
    (its rate 0), and the curve goes on."""
    print(f"bench_curves: {name} {x:,}", flush=True)
    try:
        return run(x)
    except SystemExit as exc:
        print(f"bench_curves: {name} {x:,}: {exc}", flush=True)
        return {"x": x, "rate": 0.0, "failed": str(exc)}


def rows_of(name: str, lines: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """The summary rows of one curve, and its table printed."""
    out = []
    for variant, measured in lines.items():
        label = f"{name} {variant}".strip()
        print(f"\n{label}")
        keys = list(dict.fromkeys(k for p in measured for k in p if k not in ("x", "failed")))
        print("| x | " + " | ".join(keys) + " |")
        print("|---:|" + "---:|" * len(keys))
        for p in measured:
            print(f"| {p['x']:,} | " + " | ".join(_fmt(p.get(k, "-")) for k in keys) + " |")
        for p in measured:
            if "failed" in p:
                out.append(harness.row(f"{label}: {p['x']:,}", "done", p["failed"], False))
        points = [p for p in measured if "failed" not in p]
        if not points:
            continue
        first, last = points[0], points[-1]
        if "rate" in first and name != "queues":
            for p in points[1:]:
                ratio = p["rate"] / first["rate"]
                out.append(harness.row(
                    f"{label}: good jobs' rate with {p['x']:,}", f">= {GOAL_PILE} x with "
                    f"{first['x']:,}", f"{ratio:.2f} x ({p['rate']:,.0f} vs "
                    f"{first['rate']:,.0f} jobs/s)" + _dups(p), ratio >= GOAL_PILE))
        if name == "queues":
            for p in points:
                ratio = p["rate"] / p["raw_rate"]
                out.append(harness.row(
                    f"{label}: {p['x']:,} queues", f">= {GOAL_RAW} x raw pika",
                    f"{ratio:.2f} x ({p['rate']:,.0f} vs {p['raw_rate']:,.0f} jobs/s; "
                    f"{p['rate'] / first['rate']:.2f} x the one-queue rate)",
                    ratio >= GOAL_RAW))
        if name == "dead":
            out.append(harness.row(f"drain status, {last['x']:,} dead jobs",
                                   f"<= {GOAL_STATUS:g} s",
                                   f"{last['status_cli']:.2f} s (the read "
                                   f"{last['status_read']:.3f} s)",
                                   last["status_cli"] <= GOAL_STATUS))
            out.append(harness.row(f"/metrics scrape, {last['x']:,} dead jobs",
                                   f"<= {GOAL_SCRAPE:g} s", f"{last['scrape']:.3f} s",
                                   last["scrape"] <= GOAL_SCRAPE))
            out.append(harness.row(f"drain dead list, {last['x']:,} dead jobs, the slowest "
                                   "filter", f"<= {GOAL_SCRAPE:g} s",
                                   f"{last['dead_list']:.3f} s ({last['dead_list_slowest']})",
                                   last["dead_list"] <= GOAL_SCRAPE))
        if name == "series":
            grown = last["series"] - first["series"]
            out.append(harness.row(
                f"metrics series, {last['x']:,} task names and tags",
                f"bounded: at most {MAX_GROUPS + 1} more than with {first['x']:,}",
                f"{last['series']} vs {first['series']} series", grown <= MAX_GROUPS + 1))
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.3f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _dups(point: dict[str, Any]) -> str:
    return f"; {point['duplicates']} duplicates" if "duplicates" in point else ""


def plot(results: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, axes = plt.subplots(2, (len(names) + 1) // 2, figsize=(14, 6.4), dpi=100,
                             squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        for variant, measured in results[name].items():
            points = [p for p in measured if "failed" not in p]
            xs = [max(p["x"], 1) for p in points]
            key = {"dead": "status_cli", "series": "series"}.get(name, "rate")
            ax.plot(xs, [p[key] for p in points], marker="o", label=variant or "drain")
            if name == "queues":
                ax.plot(xs, [p["raw_rate"] for p in points], marker="o", label="raw pika")
            if name == "dead":
                ax.plot(xs, [p["scrape"] for p in points], marker="o", label="scrape")
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_ylabel({"dead": "seconds", "series": "series"}.get(name, "good jobs/s"))
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path)


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--curves", default=",".join(FULL),
                        help=f"a subset of {','.join(FULL)} (default all)")
    parser.add_argument("--good", type=int, default=20_000,
                        help="jobs for the working queue per point (default 20000)")
    for name, default in FULL.items():
        parser.add_argument(f"--{name}", default=None, help=f"its points (default {default})")
    parser.add_argument("--docs-png", action="store_true", help=f"also write {DOCS_PNG}")
    args = parser.parse_args()
    sizes = SMOKE if args.smoke else FULL
    good = 1000 if args.smoke else args.good
    chosen = [c for c in args.curves.split(",") if c]
    unknown = set(chosen) - set(FULL)
    if unknown:
        parser.error(f"unknown curves {sorted(unknown)}: choose from {', '.join(FULL)}")
    print(f"bench_curves: {good:,} good jobs per point, {os.cpu_count()} cores", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    partial = harness.RESULTS / f"curves{'-smoke' if args.smoke else ''}.partial.json"
    partial.parent.mkdir(parents=True, exist_ok=True)
    for name in chosen:
        xs = [int(x) for x in (getattr(args, name) or sizes[name]).split(",") if x]
        results[name] = measure(name, xs, good)
        partial.write_text(json.dumps(results, indent=2) + "\n")  # a long run's points so far
    summary = [row for name in chosen for row in rows_of(name, results[name])]
    if not args.smoke:  # matplotlib is a bench extra: make test's smoke run has none
        pngs = [harness.RESULTS / "curves.png"] + ([DOCS_PNG] if args.docs_png else [])
        harness.RESULTS.mkdir(parents=True, exist_ok=True)
        for path in pngs:
            plot(results, path)
    harness.write_results("curves", summary, {"good": good, "curves": results},
                          smoke=args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
