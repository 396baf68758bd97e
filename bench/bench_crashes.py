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

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import bench_throughput as bt
import harness as bc
import psycopg

import drain

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_SETTINGS = "500x1,500x2,1000x1,1000x2,1000x4,500x4,5000x2"


def stage(url: str, n: int, queue: str) -> None:
    with psycopg.connect(url) as conn:
        drain.stage_many(conn, (drain.Job("bench.crash", [i], queue=queue) for i in range(n)))


def depth(queue: str) -> int:
    with bc.broker_channel() as channel:
        return int(channel.queue_declare(queue, passive=True).method.message_count)


def drain_argv(url: str, batch: int, pipeline: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "drain", "run", "--database-url", url,
            "--broker-url", bc.BROKER_URL, "--batch-size", str(batch),
            "--pipeline", str(pipeline), "--metrics-port", "0", *extra]


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"bench_crashes: timed out waiting for {what}")
        time.sleep(0.005)


def one_setting(batch: int, pipeline: int, jobs: int, kills: int,
                rng: random.Random) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    name = f"drain_bench_crash_{tag}"
    queue = f"bench_crash_{tag}"
    url = bc.fresh_database(name)
    killed = 0
    try:
        bc.declare_queue(queue)
        stage(url, jobs, queue)
        with tempfile.TemporaryFile() as log_file:
            for _ in range(kills):
                before = bc.staged_count(url)
                if before <= batch * pipeline:
                    break  # too little left for a kill to land in a busy drain
                proc = subprocess.Popen(drain_argv(url, batch, pipeline),
                                        stdout=log_file, stderr=subprocess.STDOUT)
                try:
                    wait_for(
                        lambda b=before, p=proc: bc.staged_count(url) < b or p.poll() is not None,
                        60, "the drain to start deleting")
                    # Fault injection at a random moment of the drain's work.
                    time.sleep(rng.uniform(0.0, 0.5))
                finally:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                killed += 1
            final = subprocess.run(drain_argv(url, batch, pipeline, "--exit-when-empty"),
                                   stdout=log_file, stderr=subprocess.STDOUT, timeout=600,
                                   check=False)
            if final.returncode != 0 or bc.staged_count(url) != 0:
                log_file.seek(0)
                sys.stderr.write(log_file.read().decode(errors="replace")[-4000:])
                raise SystemExit(f"bench_crashes: the last drain exited {final.returncode}")
        published = depth(queue)
    finally:
        bc.delete_queue(queue)
        bc.drop_database(name)
    duplicates = published - jobs
    if duplicates < 0:
        raise SystemExit(f"bench_crashes: {jobs - published} job(s) lost at {batch}x{pipeline}")
    return {"batch_size": batch, "pipeline": pipeline, "kills": killed,
            "duplicates": duplicates, "bound_per_kill": batch * pipeline,
            "per_kill": round(duplicates / killed, 1) if killed else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=30_000, help="jobs per setting (30000)")
    parser.add_argument("--kills", type=int, default=8, help="kill -9s per setting (8)")
    parser.add_argument("--settings", default=DEFAULT_SETTINGS,
                        help=f"BATCHxPIPELINE, comma-separated (default {DEFAULT_SETTINGS})")
    parser.add_argument("--seed", type=int, default=None, help="for the kill moments")
    parser.add_argument("--smoke", action="store_true",
                        help="a tiny run (checks the bench works; no figures)")
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
    summary = [{"target": f"duplicates per kill -9, batch {r['batch_size']} x pipeline "
                          f"{r['pipeline']}",
                "goal": f"<= {r['bound_per_kill']} (batch x pipeline)",
                "measured": f"{r['per_kill']} ({r['duplicates']} over {r['kills']} kills)",
                "met": None if args.smoke else r not in over} for r in rows]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / ("crashes-smoke.json" if args.smoke else "crashes.json")
    path.write_text(json.dumps({"name": "crashes-smoke" if args.smoke else "crashes",
                                "summary": summary, "details": {"rows": rows}}, indent=2) + "\n")
    print(f"\nwrote {path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path}")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
