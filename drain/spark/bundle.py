"""What ``spark-submit`` needs to run drain's Spark commands on a cluster.

``python -m drain.spark.bundle DIR`` writes two files into ``DIR``:

* ``drain.zip``: the ``drain`` package, zipped from wherever this interpreter
  imports it (a source checkout or an installed wheel). Spark puts a
  ``--py-files`` zip first on the executors' Python path, so they run the
  driver's very drain, whatever else the nodes have installed.
* ``drain_submit.py``: the application file (``drain.cli.spark.main``).

drain's dependencies (psycopg, pika, celery, tenacity, pyarrow, pandas) are
not in the zip: they come from the interpreter the nodes run
(``spark.pyspark.python``), where ``pip install 'drain-outbox[spark]'`` put them.
See docs/spark.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import drain

SUBMIT_SCRIPT = "from drain.cli.spark import main\n\nraise SystemExit(main())\n"


def write(directory: Path) -> tuple[Path, Path]:
    """Write ``drain.zip`` and ``drain_submit.py`` into ``directory``; return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    package = Path(drain.__file__).resolve().parent
    archive = directory / "drain.zip"
    partial = directory / "drain.zip.partial"
    with zipfile.ZipFile(partial, "w", zipfile.ZIP_DEFLATED) as out:
        for path in sorted(package.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                out.write(path, Path("drain") / path.relative_to(package))
    os.replace(partial, archive)
    script = directory / "drain_submit.py"
    script.write_text(SUBMIT_SCRIPT, encoding="utf-8")
    return archive, script


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m drain.spark.bundle",
        description="Write drain.zip (for spark-submit --py-files) and drain_submit.py "
        "(the application file) into DIR.",
    )
    parser.add_argument("directory", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    archive, script = write(args.directory)
    print(f"--py-files {archive} {script}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
