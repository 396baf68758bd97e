"""Duplicates per crash: what a kill -9 of a busy drain republishes, by batch size and pipeline.

    python bench/bench_crashes.py [--jobs 30000] [--kills 8] [--settings 500x1,1000x2,...]
                                  [--smoke]

A drain that dies between the broker's confirms and its own commit leaves the
rows of every batch in flight staged; the next leader publishes them again,
with the same task ids (at-least-once). How many that is per crash is bounded
by ``--pipeline`` x ``--batch-size``: the batches published and not yet
deleted in a committed transaction.

For each setting (BATCHxPIPELINE), in a fresh database and a fresh durable
queue: ``--jobs`` rows staged with COPY, then ``--kills`` times: ``python -m
drain run`` started, left to work until the backlog has shrunk (so the kill
lands in a busy drain, not one still connecting), a random further 0 to 0.5 s,
then SIGKILL. A last drain with ``--exit-when-empty`` delivers the rest. Every
message published stays in the queue, so the duplicates are the queue's depth
minus the jobs staged; they are reported per kill next to the bound.
Throughput for the same settings: ``bench_throughput.py --more``.

``--smoke`` (tiny sizes, two settings, one kill each) checks that the bench
works; ``make test`` runs it. Prints a table and writes
bench/results/crashes.json (crashes-smoke.json with ``--smoke``).
"""

from __future__ import annotations

import functools
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import bench_throughput as bt
import harness
import psycopg
from harness import BROKER_URL, queue_depth, staged_count

import drain

DEFAULT_SETTINGS = "500x1,500x2,1000x1,1000x2,1000x4,500x4,5000x2"


def stage(url: str, n: int, queue: str) -> None:
    with psycopg.connect(url) as conn:
        drain.stage_many(conn, (drain.Job("bench.crash", [i], queue=queue) for i in range(n)))


def drain_argv(url: str, batch: int, pipeline: int, *extra: str) -> list[str]:
    return ["run", "--database-url", url, "--broker-url", BROKER_URL, "--batch-size", str(batch),
            "--pipeline", str(pipeline), "--metrics-port", "0", *extra]


def started(url: str, staged_before: int, proc: subprocess.Popen[bytes]) -> bool:
    """The drain has deleted rows (or exited)."""
    return staged_count(url) < staged_before or proc.poll() is not None


def one_setting(batch: int, pipeline: int, jobs: int, kills: int,
                rng: random.Random) -> dict[str, Any]:
    killed = 0
    with harness.Setup("crash") as setup, tempfile.TemporaryFile() as log_file:
        url, queue = setup.database(), setup.queue()
        stage(url, jobs, queue)
        for _ in range(kills):
            before = staged_count(url)
            if before <= batch * pipeline:
                break  # too little left for a kill to land in a busy drain
            proc = harness.drain_process(*drain_argv(url, batch, pipeline), log=log_file)
            try:
                harness.wait_until(functools.partial(started, url, before, proc), 60,
                                   "bench_crashes: the drain to start deleting", interval=0.005)
                # Fault injection at a random moment of the drain's work.
                time.sleep(rng.uniform(0.0, 0.5))
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(10)
            killed += 1
        final = harness.drain_process(*drain_argv(url, batch, pipeline, "--exit-when-empty"),
                                      log=log_file)
        try:
            returncode = final.wait(600)
        finally:
            harness.stop([final])
        if returncode != 0 or staged_count(url) != 0:
            log_file.seek(0)
            sys.stderr.write(log_file.read().decode(errors="replace")[-4000:])
            raise SystemExit(f"bench_crashes: the last drain exited {returncode}")
        published = queue_depth(queue)
    duplicates = published - jobs
    if duplicates < 0:
        raise SystemExit(f"bench_crashes: {jobs - published} job(s) lost at {batch}x{pipeline}")
    return {"batch_size": batch, "pipeline": pipeline, "kills": killed,
            "duplicates": duplicates, "bound_per_kill": batch * pipeline,
            "per_kill": round(duplicates / killed, 1) if killed else None}


def main() -> int:
    parser = harness.parser(__doc__)
    parser.add_argument("--jobs", type=int, default=30_000, help="jobs per setting (30000)")
    parser.add_argument("--kills", type=int, default=8, help="kill -9s per setting (8)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help=f"BATCHxPIPELINE, comma-separated (default {DEFAULT_SETTINGS})")
    parser.add_argument("--seed", type=int, default=None, help="for the kill moments")
    args = parser.parse_args()
    if args.smoke:
        args.jobs, args.kills, args.settings = 3000, 1, "100x1,100x3"
    rng = random.Random(args.seed)
    rows = [one_setting(*bt.parse_setting(s), args.jobs, args.kills, rng)
            for s in args.settings.split(",") if s]

    print(f"\nduplicates per kill -9, {args.jobs} jobs per setting, {os.cpu_count()} cores\n")
    print("| batch size | pipeline | kills | duplicates | per kill | bound per kill |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch_size']} | {r['pipeline']} | {r['kills']} | {r['duplicates']} | "
              f"{r['per_kill']} | {r['bound_per_kill']} |")
    over = [r for r in rows if r["kills"] and r["duplicates"] > r["kills"] * r["bound_per_kill"]]
    for r in over:
        print(f"over the bound: {r}", file=sys.stderr)
    harness.write_results("crashes", [
        harness.row(f"duplicates per kill -9, batch {r['batch_size']} x pipeline {r['pipeline']}",
                    f"<= {r['bound_per_kill']} (batch x pipeline)",
                    f"{r['per_kill']} ({r['duplicates']} over {r['kills']} kills)",
                    r not in over) for r in rows], {"rows": rows}, smoke=args.smoke)
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
