"""bench_throughput --profile: one drain round under py-spy, and where the time goes."""

from __future__ import annotations

import collections
import dataclasses
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psycopg
from harness import BROKER_URL, RESULTS, ROOT, declare_queue, delete_queue, stage

#: "function (file:line)" as py-spy writes a frame.
FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^()]*?)(?::\d+)?\)$")
DRAIN_FILE = re.compile(r"(^|/)drain/(?:[^/]+/)*[^/]+\.py$")
#: Frames of the process's entry (runpy, the CLI): on every stack, they tell nothing.
ENTRY_FILE = re.compile(r"^<frozen runpy>$|(^|/)drain/(__main__|cli/main)\.py$")
#: Leaf frames that are the drain blocked on a socket, not working.
BROKER_WAIT = re.compile(r"^\w*Poller\.poll \(pika/")
POSTGRES_WAIT = re.compile(r"^(Connection\.wait \(psycopg/|wait\w* \(psycopg/waiting)")
NO_STACK = "(no Python stack)"
#: The root frame of every thread but the main one (the sampler, the HTTP server,
#: the watchdog): their idle waits are not the drain loop's.
THREAD_ROOT = re.compile(r"^(Thread\.)?_bootstrap \(.*threading\.py")
IMPORTS = "(start-up: imports)"


@dataclasses.dataclass(frozen=True)
class Frame:
    name: str  # "Store.fetch (drain/postgres/store.py)": the function, without the line
    file: str

    @property
    def ours(self) -> bool:
        return bool(DRAIN_FILE.search(self.file))


def _frame(text: str) -> Frame:
    match = FRAME.match(text)
    if match is None:
        return Frame(text, "")
    return Frame(f"{match['function']} ({match['file']})", match["file"])


def read_collapsed(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's ``--format raw`` output: one "frame;frame;...;frame count" line per stack."""
    stacks = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if count.isdigit():
            stacks.append(([f for f in stack.split(";") if f.strip()], int(count)))
    return stacks


def _activity(frames: list[Frame], deepest_drain: Frame | None) -> str:
    """What the drain was doing in one sample, in a few coarse kinds."""
    names = [f.name for f in frames]
    if not any(name.startswith("Pipeline.cycle ") for name in names):
        return "outside the cycle: start-up, connecting, shut-down"
    leaf = names[-1]
    if BROKER_WAIT.match(leaf):
        return "idle: waiting on the broker socket (confirms)"
    if POSTGRES_WAIT.match(leaf):
        return "idle: waiting on Postgres (fetch, delete, commit)"
    where = deepest_drain.file if deepest_drain else ""
    if where.endswith(("drain/celery/message.py", "drain/broker/amqp.py")):
        return "CPU: building and encoding messages (drain.celery.message, drain.broker.amqp)"
    if where.endswith(("drain/postgres/store.py", "drain/postgres/keyset.py")):
        return "CPU: Postgres client (psycopg: send queries, adapt ids, parse rows)"
    if where.endswith(("drain/broker/publisher.py", "drain/broker/queue_declare.py",
                       "drain/broker/amqp_link.py")):
        return "CPU: pika (marshal frames, socket writes, read confirms)"
    return "CPU: the drain loop (runner, other)"


def where_the_time_goes(stacks: list[tuple[list[str], int]], top: int) -> dict[str, Any]:
    """Where the main thread's samples fall, four ways (other threads' are only counted).

    * by activity: waiting on the broker or Postgres versus CPU, by kind of work;
    * by drain function: the deepest frame in the drain package (its own code plus the
      library calls it makes, less deeper drain frames); imports are one bucket;
    * by own time: the sampled (leaf) frame;
    * by cumulative time: anywhere on the stack, once per stack (the entry frames,
      runpy and the CLI, left out).
    """
    activity: collections.Counter[str] = collections.Counter()
    by_drain: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    cumulative: collections.Counter[str] = collections.Counter()
    total = other_threads = 0
    for texts, count in stacks:
        if texts and THREAD_ROOT.match(texts[0]):
            other_threads += count
            continue
        total += count
        frames = [_frame(t) for t in texts]
        if not frames:
            for counter in (activity, by_drain, own, cumulative):
                counter[NO_STACK] += count
            continue
        deepest = next((f for f in reversed(frames) if f.ours), None)
        if any(f.name.startswith("_find_and_load ") for f in frames):
            activity[IMPORTS] += count
            by_drain[IMPORTS] += count
        else:
            activity[_activity(frames, deepest)] += count
            by_drain[deepest.name if deepest else "(no drain frame)"] += count
        own[frames[-1].name] += count
        for name in {f.name for f in frames if not ENTRY_FILE.search(f.file)}:
            cumulative[name] += count

    def rows(counter: collections.Counter[str], n: int) -> list[dict[str, Any]]:
        return [{"function": name, "samples": c, "percent": round(100 * c / max(total, 1), 1)}
                for name, c in counter.most_common(n)]

    return {"samples": total, "other_thread_samples": other_threads,
            "by_activity": rows(activity, len(activity)),
            "by_drain_function": rows(by_drain, top), "own": rows(own, top),
            "cumulative": rows(cumulative, top)}


def find_py_spy() -> str:
    """py-spy beside this interpreter (the venv) or on PATH."""
    path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    found = shutil.which("py-spy", path=path)
    if found is None:
        raise SystemExit("--profile needs py-spy: pip install py-spy "
                         "(`make bench-profile` installs it into .venv)")
    return found


def profile_drain(url: str, n: int, queue: str, *, batch_size: int, pipeline: int,
                  rate: int, top: int) -> dict[str, Any]:
    """Drain ``n`` staged rows with ``python -m drain run`` under py-spy; where the time goes."""
    py_spy = find_py_spy()
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / "throughput-profile.txt"
    stage(url, n, queue)
    declare_queue(queue)
    command = [
        py_spy, "record", "--idle", "--format", "raw", "--rate", str(rate), "-o", str(out),
        "--", sys.executable, "-m", "drain", "run", "--exit-when-empty",
        "--database-url", url, "--broker-url", BROKER_URL, "--batch-size", str(batch_size),
        "--pipeline", str(pipeline),
    ]
    with tempfile.TemporaryFile("w+") as log_file:
        t0 = time.perf_counter()
        proc = subprocess.run(command, stdout=log_file, stderr=subprocess.STDOUT, text=True,
                              cwd=ROOT, check=False)
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            log_file.seek(0)
            sys.stderr.write(log_file.read()[-4000:])
            raise SystemExit(f"the profiled drain failed (py-spy exit {proc.returncode}); "
                             "py-spy needs ptrace (root, or kernel.yama.ptrace_scope 0)")
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM staged_jobs").fetchone()
    assert row is not None and row[0] == 0, f"{row} rows left staged after the profiled drain"
    delete_queue(queue)
    profile = where_the_time_goes(read_collapsed(out), top)
    return {
        "tool": f"py-spy record --idle --format raw --rate {rate} (wall clock, waiting included)",
        "jobs": n,
        "seconds": round(elapsed, 2),
        "msg_per_s": round(n / elapsed),
        "collapsed_stacks": str(out.relative_to(ROOT)),
        **profile,
    }


def print_profile(profile: dict[str, Any]) -> None:
    print(f"\nwhere the time goes: {profile['jobs']} jobs drained by `python -m drain run` "
          f"in {profile['seconds']} s ({profile['msg_per_s']} msg/s with process start-up and "
          f"sampling), {profile['samples']} samples of the main thread (the drain loop; "
          f"{profile['other_thread_samples']} of other threads left out), {profile['tool']}; "
          f"stacks in {profile['collapsed_stacks']}")
    for key, title in (("by_activity", "by activity"),
                       ("by_drain_function", "by drain function (with the library calls it makes)"),
                       ("own", "by own time (the sampled frame itself)"),
                       ("cumulative", "by cumulative time (anywhere on the stack, "
                                      "less the entry frames)")):
        rows = profile[key]
        w = max([len(title)] + [len(r["function"]) for r in rows])
        print(f"\n| {title:<{w}} |      % | samples |")
        print(f"|{'-' * (w + 2)}|{'-' * 8}|{'-' * 9}|")
        for r in rows:
            print(f"| {r['function']:<{w}} | {r['percent']:>6.1f} | {r['samples']:>7} |")
