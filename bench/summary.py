"""One markdown table of every benchmark result in bench/results/*.json.

    python bench/summary.py [--results DIR]

Each bench writes ``bench/results/<name>.json`` (see bench/README.md):

    {"name": "<name>",
     "summary": [{"target": ..., "goal": ..., "measured": ..., "met": true | false | null}],
     "details": {...}}

Rows come in the order of the performance targets (throughput, latency, mvcc,
memory, lanes), then any other result by name. A target with no result file
shows as "not run"; an unreadable file shows why. Never fails on what it reads:
`make bench` runs it last, and the figures are never a gate.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
#: The performance targets, in the order they are listed; other results follow.
TARGETS = ("throughput", "latency", "mvcc", "memory", "lanes")
MET = {True: "yes", False: "**no**", None: "-"}


def load(path: Path) -> tuple[str, list[dict[str, Any]]]:
    """A result's name and summary rows; one explanatory row when the file is unusable."""
    def unusable(why: str) -> tuple[str, list[dict[str, Any]]]:
        return path.stem, [{"target": path.stem, "goal": "",
                            "measured": f"unreadable {path.name}: {why}", "met": None}]

    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return unusable(f"{type(exc).__name__}: {exc}")
    rows = data.get("summary") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        return unusable("no 'summary' list of objects")
    return str(data.get("name") or path.stem), rows


def cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(results_dir: Path) -> str:
    found: dict[str, list[dict[str, Any]]] = {}
    if results_dir.is_dir():
        for path in sorted(results_dir.glob("*.json")):
            name, loaded = load(path)
            found.setdefault(name, []).extend(loaded)
    order = [*TARGETS, *sorted(name for name in found if name not in TARGETS)]
    lines = ["| target | goal | measured | met |", "|---|---|---|---|"]
    for name in order:
        rows = found.get(name)
        if not rows:
            lines.append(f"| {name} | | not run | - |")
            continue
        for row in rows:
            met = row.get("met")
            verdict = MET[met] if met is None or isinstance(met, bool) else cell(met)
            lines.append(
                f"| {cell(row.get('target', name))} | {cell(row.get('goal', ''))} | "
                f"{cell(row.get('measured', ''))} | {verdict} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS,
                        help=f"directory of <name>.json results (default {RESULTS})")
    args = parser.parse_args()
    if not args.results.is_dir():
        print(f"({args.results} does not exist: no benchmark has written a result)\n")
    print(table(args.results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
