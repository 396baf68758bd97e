"""Staging throughput under many concurrent writers: what the wake-up costs the application.

    python bench/bench_staging.py [--writers 8,32,64] [--seconds 10] [--rounds 3]
                                  [--idle-seconds 20] [--docs-png] [--smoke]

Target (issue 13): single-row staging transactions from 32 and from 64
concurrent writers, with a drain running and publishing, reach >= 0.95 x the
throughput of the same workload on the same table with no trigger at all, and
throughput rises (or holds) from 8 to 64 writers.

Set-up: a fresh database migrated with ``drain.postgres.migration.migrate``, a fresh queue,
and ``drain run`` as a separate process, publishing throughout. The writers
are ``pgbench`` (a C client, so the clients do not take the CPU the server
needs), ``-M prepared``, each transaction one ``INSERT INTO staged_jobs``
committed on its own, with ``fsync`` and ``synchronous_commit`` on. Three
table variants, in alternating rounds of ``--seconds`` each:

* ``shipped``: staging_schema.sql as it is (the wake flag, drain/postgres/wakeup.py);
* ``notify``: the trigger before the handshake, one NOTIFY per staging statement;
* ``none``: every trigger of staged_jobs disabled (``DISABLE TRIGGER USER``).

Before each round the drain has emptied the table, which is then vacuumed and
checkpointed. Reported per variant and writer count: the median throughput of
the rounds and the writers' commit latency percentiles (pgbench's
per-transaction log). Finally the idle drain's own cost: transactions per
second in the database while nothing is staged (``pg_stat_database``).

``--smoke`` runs one 1-second round with 2 writers (checks the bench works;
the figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import harness
import psycopg
from cpu import process_seconds
from harness import BROKER_URL, ROOT, broker_channel, staged_count

GOAL = 0.95
VARIANTS = ("shipped", "notify", "none")
#: The trigger before the handshake (one NOTIFY per staging statement).
NOTIFY_ALWAYS = """
CREATE OR REPLACE TRIGGER staged_jobs_notify AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION staged_jobs_notify();
"""
TPS = re.compile(r"^tps = ([0-9.]+) \(without initial connection time\)", re.M)


def pgbench() -> str:
    found = shutil.which("pgbench")
    if found:
        return found
    for candidate in sorted(Path("/usr/lib/postgresql").glob("*/bin/pgbench"), reverse=True):
        return str(candidate)
    raise SystemExit("bench_staging: pgbench not found (it ships with the postgresql packages)")


def set_variant(url: str, variant: str, shipped_trigger: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        if variant == "none":
            conn.execute("ALTER TABLE staged_jobs DISABLE TRIGGER USER")
            return
        conn.execute("ALTER TABLE staged_jobs ENABLE TRIGGER USER")
        conn.execute(NOTIFY_ALWAYS if variant == "notify" else shipped_trigger)


def shipped_trigger_definition(url: str) -> str:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT pg_get_triggerdef(oid) FROM pg_trigger "
                           "WHERE tgname = 'staged_jobs_notify'").fetchone()
    assert row is not None and str(row[0]).startswith("CREATE TRIGGER ")
    return "CREATE OR REPLACE TRIGGER " + str(row[0])[len("CREATE TRIGGER "):]


def settle(url: str, queue: str) -> None:
    """Between rounds: the drain has published everything; vacuum, checkpoint, purge."""
    harness.wait_until(lambda: staged_count(url) == 0, 300, "bench_staging: the drain "
                       "emptying staged_jobs", interval=0.2)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("VACUUM staged_jobs")
        conn.execute("CHECKPOINT")
    with broker_channel() as channel:
        channel.queue_purge(queue)


def run_round(url: str, script: Path, writers: int, seconds: float, logdir: Path) -> dict[str, Any]:
    name = url.rsplit("/", 1)[1]
    prefix = logdir / f"r{uuid.uuid4().hex[:6]}"
    cmd = [pgbench(), "-n", "-M", "prepared", "-c", str(writers), "-j", str(min(writers, 2)),
           "-T", str(max(1, round(seconds))), "-f", str(script), "-l",
           f"--log-prefix={prefix}", "-h", "127.0.0.1", "-U", "postgres", name]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=logdir)
    if out.returncode != 0:
        raise SystemExit(f"bench_staging: pgbench failed: {out.stderr.strip()[-500:]}")
    match = TPS.search(out.stdout)
    if not match:
        raise SystemExit(f"bench_staging: no tps in pgbench's output: {out.stdout[-500:]}")
    latencies: list[float] = []
    for log in logdir.glob(f"{prefix.name}*"):
        for line in log.read_text().splitlines():
            fields = line.split()
            if len(fields) >= 3:
                latencies.append(int(fields[2]) / 1000.0)  # microseconds -> ms
        log.unlink()
    latencies.sort()
    return {"tps": float(match.group(1)), "transactions": len(latencies),
            "p50_ms": rank(latencies, 0.5), "p99_ms": rank(latencies, 0.99)}


def rank(ordered: list[float], q: float) -> float:
    """The value at rank ``q`` (0-1) of the sorted values, not interpolated."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def idle_cost(url: str, seconds: float) -> float:
    """Transactions per second in the database while the drain idles (nothing staged)."""
    name = url.rsplit("/", 1)[1]
    query = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        first = conn.execute(query, (name,)).fetchone()
        time.sleep(seconds)
        conn.execute("SELECT pg_stat_clear_snapshot()")
        last = conn.execute(query, (name,)).fetchone()
    assert first is not None and last is not None
    # Our own two reads count too.
    return (int(last[0]) - int(first[0]) - 2) / seconds


def plot(results: dict[str, dict[int, dict[str, Any]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    labels = {"shipped": "shipped (wake flag)", "notify": "NOTIFY per statement (before)",
              "none": "no trigger at all"}
    for variant, by_writers in results.items():
        xs = sorted(by_writers)
        ax.plot(xs, [by_writers[x]["tps"] for x in xs], marker="o", label=labels[variant])
    ax.set_xlabel("concurrent writers (pgbench, one INSERT per transaction)")
    ax.set_ylabel("staging transactions/s")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def parse_args() -> argparse.Namespace:
    parser = harness.parser(__doc__, rounds=3)
    parser.add_argument("--writers", default="8,32,64")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"a subset of {','.join(VARIANTS)} (default all; shipped and "
                        "none are needed for the ratios)")
    parser.add_argument("--docs-png", action="store_true", help="write docs/staging.png")
    args = parser.parse_args()
    if args.smoke:
        args.writers, args.seconds, args.rounds, args.idle_seconds = "2", 1.0, 1, 1.0
    args.variants = [v for v in VARIANTS if v in args.variants.split(",")]
    if not {"shipped", "none"} <= set(args.variants):
        parser.error("--variants must include shipped and none (the ratio)")
    return args


def main() -> int:
    args = parse_args()
    counts, variants = [int(w) for w in args.writers.split(",")], args.variants
    raw: dict[str, dict[int, list[dict[str, Any]]]] = {v: {w: [] for w in counts}
                                                        for v in variants}
    with harness.Setup("staging") as setup, tempfile.TemporaryDirectory() as tmp:
        url, queue = setup.database(), setup.queue()
        shipped = shipped_trigger_definition(url)
        log = setup.enter_context((Path(tmp) / "drain.log").open("w+b"))
        drain_proc = setup.process(harness.drain_process(
            "run", log=log,
            env={**os.environ, "DRAIN_DATABASE_URL": url, "DRAIN_BROKER_URL": BROKER_URL,
                 "DRAIN_METRICS_PORT": "0"}))
        script = Path(tmp) / "stage.sql"
        script.write_text("INSERT INTO staged_jobs (task_name, kwargs, queue) "
                          f"VALUES ('bench.noop', '{{\"n\": 1}}', '{queue}');\n")

        def one_round(round_no: int, variant: str, writers: int) -> None:
            set_variant(url, variant, shipped)
            settle(url, queue)
            cpu = process_seconds(drain_proc.pid)
            result = run_round(url, script, writers, args.seconds, Path(tmp))
            result["drain_cpu"] = (process_seconds(drain_proc.pid) - cpu) / args.seconds
            raw[variant][writers].append(result)
            print(f"round {round_no + 1} writers {writers:>2} {variant:>7}: "
                  f"{result['tps']:8.0f} tx/s  p50 {result['p50_ms']:.2f} ms  "
                  f"p99 {result['p99_ms']:.2f} ms  drain CPU "
                  f"{100 * result['drain_cpu']:.0f} %", flush=True)

        for round_no in range(args.rounds):
            for writers in counts:
                for variant in harness.turns(round_no, variants):
                    one_round(round_no, variant, writers)
        set_variant(url, "shipped", shipped)
        settle(url, queue)
        idle = idle_cost(url, args.idle_seconds)
        if drain_proc.poll() is not None:
            raise SystemExit("bench_staging: the drain exited: "
                             + (Path(tmp) / "drain.log").read_text(errors="replace")[-500:])
    results = {v: {w: {"tps": statistics.median(r["tps"] for r in raw[v][w]),
                       "p50_ms": statistics.median(r["p50_ms"] for r in raw[v][w]),
                       "p99_ms": statistics.median(r["p99_ms"] for r in raw[v][w]),
                       "rounds": raw[v][w]}
                   for w in counts} for v in variants}
    print_table(results, counts, idle)
    if args.docs_png and not args.smoke:
        plot(results, ROOT / "docs" / "staging.png")
    harness.write_results("staging", summary_rows(results, counts, idle), smoke=args.smoke,
                          details={"results": results, "idle_tps": idle, "args": vars(args)})
    return 0


def print_table(results: dict[str, dict[int, dict[str, Any]]], counts: list[int],
                idle: float) -> None:
    print("\n| writers | shipped tx/s | NOTIFY per statement | no trigger | shipped / none "
          "| before / none | shipped p50 / p99 ms | none p50 / p99 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for w in counts:
        s, n = results["shipped"][w], results["none"][w]
        o = results.get("notify", {}).get(w, {"tps": float("nan")})
        print(f"| {w} | {s['tps']:,.0f} | {o['tps']:,.0f} | {n['tps']:,.0f} | "
              f"{s['tps'] / n['tps']:.2f} | {o['tps'] / n['tps']:.2f} | "
              f"{s['p50_ms']:.2f} / {s['p99_ms']:.2f} | {n['p50_ms']:.2f} / {n['p99_ms']:.2f} |")
    print(f"\nidle drain: {idle:.1f} transactions/s in its database")


def summary_rows(results: dict[str, dict[int, dict[str, Any]]], counts: list[int],
                 idle: float) -> list[dict[str, Any]]:
    rows = []
    for w in counts:
        ratio = results["shipped"][w]["tps"] / results["none"][w]["tps"]
        rows.append(harness.row(f"staging, {w} writers", f">= {GOAL} x no trigger",
                                f"{ratio:.2f} x ({results['shipped'][w]['tps']:,.0f} vs "
                                f"{results['none'][w]['tps']:,.0f} tx/s)",
                                None if w < 32 else ratio >= GOAL))
    tps = [results["shipped"][w]["tps"] for w in counts]
    rows.append(harness.row("staging scales with writers", "rises or holds 8 -> 64",
                            " -> ".join(f"{t:,.0f}" for t in tps),
                            None if len(tps) < 2 else tps[-1] >= 0.95 * tps[0]))
    rows.append(harness.row("idle drain", "a handful of queries/s",
                            f"{idle:.1f} transactions/s", None))
    return rows


if __name__ == "__main__":
    sys.exit(main())
