"""bench_throughput's ``drain run --app`` rounds (bench/bench_app.py's apps) and how
they are quoted: against raw pika through the same kind of exchange."""

from __future__ import annotations

import argparse
import time
from typing import Any

import cpu
from harness import BROKER_URL, declare_queue, delete_queue, queue_depth, stage

from drain.daemon.runner import Drain
from drain.settings.config import Settings

GOAL_JOBS = 200_000
GOAL_X_RAW = 0.9

#: The --app rounds: bench/bench_app.py's apps.
APPS = {
    "static": "drain run --app, static task_routes (cached per task)",
    "function": "drain run --app, a router function (called per row)",
}
#: The --app rounds' ceiling: what their messages cross in RabbitMQ, a named exchange.
ROUTED = "raw pika, pre-encoded, through a direct exchange (as --app), best window"


def run_drain(url: str, batch_size: int, pipeline: int, app: str = "") -> tuple[float, int]:
    d = Drain(Settings(database_url=url, broker_url=BROKER_URL, batch_size=batch_size,
                       pipeline=pipeline, celery_app=app),
              exit_when_empty=True)
    t0 = time.perf_counter()
    d.run()
    return time.perf_counter() - t0, d.published


def app_round(url: str, n: int, queue: str, app: str, *, size: tuple[int, int],
              cpu_used: dict[str, list[dict[str, float]]]) -> float:
    """One drain round with ``--app bench_app:APP``: ``n`` rows staged without a
    queue, routed by the app to ``queue``; its seconds."""
    stage(url, n, None, vacuum=True)
    declare_queue(queue)
    before = cpu.sample()
    elapsed, published = run_drain(url, *size, app=f"bench_app:{app}")
    cpu_used[APPS[app]].append(cpu.per_message(before, cpu.sample(), n))
    assert published == n, (published, n)
    assert queue_depth(queue) == n, "the app routed jobs elsewhere"
    delete_queue(queue)
    return elapsed


def parse_apps(text: str) -> list[str]:
    """``--apps static,function`` ('' for none)."""
    apps = [a for a in text.split(",") if a]
    if set(apps) - set(APPS):
        raise argparse.ArgumentTypeError(f"choose from {', '.join(APPS)}, got {text!r}")
    return apps


def app_rows(n: int, app_rates: dict[str, float], raw_rate: float) -> list[dict[str, Any]]:
    """The --app rows: static routes have the drain's goal; a router function is reported."""
    at_goal_size = n >= GOAL_JOBS
    size = "" if at_goal_size else f" (at {n:,} jobs: not the goal's size)"
    rows = []
    for app, rate in app_rates.items():
        static = app == "static"
        rows.append({
            "target": f"throughput with --app ({'static routes' if static else 'router function'})",
            "goal": (f">= {GOAL_X_RAW} x raw pika through the same exchange" if static
                     else "reported (the router runs per row)"),
            "measured": f"{rate / raw_rate:.2f} x ({rate:,.0f} vs {raw_rate:,.0f} msg/s){size}",
            "met": (rate / raw_rate >= GOAL_X_RAW) if static and at_goal_size else None,
        })
    return rows


def print_ratios(rates: dict[str, float], apps: list[str]) -> None:
    """Each --app round against raw pika through the same exchange."""
    for app in apps if ROUTED in rates else ():
        print(f"--app {app} / raw pika through the same exchange = "
              f"{rates[APPS[app]] / rates[ROUTED]:.2f}"
              + (f" (goal >= {GOAL_X_RAW})" if app == "static" else ""))
