"""Throughput into a quorum queue on a three-node RabbitMQ cluster (issue 37).

In one run, on the cluster tests/rabbit_cluster/cluster.py starts (three
nodes on this machine) and the machine's own single node:

* the drain into a quorum queue on the cluster (through its first node, which
  leads the queue), at batch size x pipeline 1000 x 4, 1000 x 8 and 5000 x 2;
* the drain into a classic queue on the single node, at the same depths;
* raw pika publishing the drain's exact messages to the same quorum queue,
  with confirm windows of 4,000, 8,000 and 10,000 (the same messages in flight).

Each variant runs ``--rounds`` times, in turns, each drain round on a vacuumed
table (as bench_throughput's); the best of each is compared:
quorum / classic (what replication costs the drain) and drain / raw pika on
the quorum queue (the goal: >= 0.9), with where each best round's CPU went
(bench/cpu.py: this process, which runs the drain or raw pika, every RabbitMQ
node, Postgres, and the machine's busy share). Writes bench/results/cluster.json. Needs
root (the cluster's nodes) and Debian's RabbitMQ: ``make bench-cluster``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import cpu
import harness
import psycopg
from bench_throughput import raw_pika, staged_messages
from curves import sql_stage
from harness import BROKER_URL, broker_channel

from drain.settings.config import Settings
from tests.rabbit_cluster import cluster as rabbit

DEPTHS = ((1000, 4), (1000, 8), (5000, 2))
#: raw pika's confirm windows: the same messages in flight as each depth's most.
WINDOWS = tuple(size * pipeline for size, pipeline in DEPTHS)
TASK = "bench.cluster"
RESULTS = Path(__file__).resolve().parent / "results"


def drain_seconds(url: str, broker: str, n: int, depth: tuple[int, int]) -> float:
    """The drain, in a thread of this process, until the broker confirmed all ``n``,
    timed by its own count (harness.seconds_to_confirm)."""
    batch_size, pipeline = depth
    return harness.seconds_to_confirm(
        Settings(database_url=url, broker_url=broker, batch_size=batch_size,
                 pipeline=pipeline, queue_declare="passive"), n, 600, "bench_cluster")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    n = args.jobs
    with tempfile.TemporaryDirectory(prefix="bench-rabbit-cluster-") as root, \
            rabbit.running(Path(root)) as cluster, harness.Setup("cluster") as setup:
        first = cluster.nodes[0]
        url = setup.database()
        quorum = f"bench_cluster_quorum_{setup.tag}"
        with first.channel() as channel:
            channel.queue_declare(quorum, durable=True, arguments={"x-queue-type": "quorum"})
        classic = setup.queue("classic")
        sql_stage(url, n, quorum, TASK)
        messages = staged_messages(url)  # what raw pika publishes
        with psycopg.connect(url) as conn:
            conn.execute("DELETE FROM staged_jobs")
        seconds: dict[str, list[float]] = {}
        used: dict[str, dict[str, float]] = {}  # CPU per message of each variant's best round
        for round_ in range(args.rounds):
            variants = [("drain_quorum", d) for d in DEPTHS] + [
                ("drain_classic", d) for d in DEPTHS] + [
                ("raw_quorum", (w, 1)) for w in WINDOWS]
            for who, depth in harness.turns(round_, variants):
                key = f"{who}_{depth[0] * depth[1]}"
                if who != "raw_quorum":
                    with psycopg.connect(url, autocommit=True) as conn:
                        # Without the dead rows of the rounds before (the table empties).
                        conn.execute("VACUUM ANALYZE staged_jobs")
                    sql_stage(url, n, quorum if who == "drain_quorum" else classic, TASK)
                before = cpu.sample()
                if who == "raw_quorum":
                    took = raw_pika(messages, pre_encoded=True, window=depth[0],
                                    broker=first.url)
                else:
                    took = drain_seconds(url, first.url if who == "drain_quorum"
                                         else BROKER_URL, n, depth)
                spent = cpu.per_message(before, cpu.sample(), n)
                if took <= min(seconds.get(key, [took])):
                    used[key] = spent
                on_classic = who == "drain_classic"
                with (broker_channel if on_classic else first.channel)() as channel:
                    channel.queue_purge(classic if on_classic else quorum)
                seconds.setdefault(key, []).append(took)
                print(f"  {key}: {n / took:,.0f} jobs/s; CPU per message: {spent}", flush=True)
    rates = {key: n / min(values) for key, values in seconds.items()}
    best = {who: max(r for k, r in rates.items() if k.startswith(who))
            for who in ("drain_quorum", "drain_classic", "raw_quorum")}
    result = {
        "jobs": n, "rates": rates, "best": best, "cpu_per_message": used,
        "quorum_vs_classic": best["drain_quorum"] / best["drain_classic"],
        "drain_vs_raw_quorum": best["drain_quorum"] / best["raw_quorum"],
        "same_window": {str(w): rates[f"drain_quorum_{w}"] / rates[f"raw_quorum_{w}"]
                        for w in WINDOWS},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cluster.json").write_text(json.dumps(result, indent=2))
    print(f"drain into a 3-node quorum queue: {best['drain_quorum']:,.0f} jobs/s; "
          f"into a single-node classic queue: {best['drain_classic']:,.0f} "
          f"({result['quorum_vs_classic']:.2f} x); raw pika into the quorum queue: "
          f"{best['raw_quorum']:,.0f} (drain {result['drain_vs_raw_quorum']:.2f} x; "
          "same window: " + ", ".join(f"{w}: {r:.2f} x"
                                       for w, r in result["same_window"].items()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
