"""``drain backfill`` and ``drain reconcile``: the Spark commands.

:func:`add_parsers` registers both on the ``drain`` command's subparsers.
Nothing here imports pyspark until a handler runs, so ``drain --help`` and the
rest of drain work without it (``pip install 'drain-outbox[spark]'`` adds it).
``python -m drain.spark`` runs the two commands alone (also the entry point
to give ``spark-submit``, see docs/spark.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as dt
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from drain import version
from drain.cli import common as cli_common
from drain.errors import ConfigError, DatabaseUnavailable, DrainError, UsageError
from drain.spark import errors, output, sources
from drain.spark import mapping as mapping_

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_EPILOG = (
    "Runs on Spark: local[*] by default (pip install 'drain-outbox[spark]' and a Java "
    "runtime), or on a cluster through spark-submit (see docs/spark.md). Exit codes: 0 ok, "
    "1 Spark failed (a task's error, the Spark JVM lost) or unexpected error, 2 bad usage or "
    "input, 3 database unavailable (also: it closed a partition's connection), 4 schema "
    "missing, 6 a resume would partition differently."
)


# -- parsers ---------------------------------------------------------------------------


def add_parsers(sub: Any) -> None:
    """Register ``backfill`` and ``reconcile`` on ``drain``'s subparsers."""

    p = sub.add_parser(
        "backfill",
        help="stage one job per record of a dataset, on Spark (idempotent per --id)",
        description="Stage one job per record of a Parquet/CSV/JSON dataset or a Postgres "
        "table or query. Each Spark partition stages its jobs with COPY in one transaction "
        "that also records it in drain_backfill_ledger: a retried task or a re-run with the "
        "same --id never stages a record twice.",
        epilog=_EPILOG,
    )
    cli_common.add_database(p)
    _add_source(p, "--source", "the records: parquet:PATH, csv:PATH, json:PATH, table:NAME "
                "or 'query:SELECT ...'")
    p.add_argument("--where", metavar="SQL", help="only the records matching this Spark SQL "
                   "condition, e.g. \"user_id IN (1, 2)\"")
    p.add_argument("--key", default="id", metavar="EXPR",
                   help="the record's unique key (column or Spark SQL expression, default id): "
                   "it fixes the job's task id and its partition")
    _add_mapping(p, required=True)
    p.add_argument("--id", dest="run_id", metavar="ID",
                   help="the backfill id (default: the tag); a re-run with the same id stages "
                   "only the partitions that never committed")
    p.add_argument("--dry-run", action="store_true",
                   help="print how many jobs would be staged and a sample; stage nothing")
    p.add_argument("--sample", type=int, default=5, metavar="N",
                   help="jobs shown by --dry-run (default 5)")
    _add_run(p)
    p.set_defaults(func=cmd_backfill)

    p = sub.add_parser(
        "reconcile",
        help="find records missing or stale downstream; with --stage, stage their repair",
        description="Compare the source of truth (id and version) with the downstream's view "
        "(a table, or files exported from it): report missing, stale and extra ids; with "
        "--stage, stage a repair job per missing or stale record through the backfill's "
        "idempotent writer.",
        epilog=_EPILOG,
    )
    cli_common.add_database(p)
    _add_source(p, "--source", "the source of truth: table:NAME, 'query:SELECT ...', or "
                "parquet:/csv:/json:PATH")
    p.add_argument("--downstream", required=True, type=_source, metavar="KIND:WHAT",
                   help="the downstream's view, e.g. table:search_index or parquet:/exports/ix")
    p.add_argument("--downstream-url", metavar="URL",
                   help="Postgres URL of a table:/query: downstream (default --database-url)")
    p.add_argument("--downstream-partition-column", metavar="COLUMN",
                   help="read a table:/query: downstream in parallel, split on this numeric "
                   "column (as --partition-column does for the source; --read-partitions "
                   "applies to both)")
    p.add_argument("--id-column", default="id", help="the source's id column (default id)")
    p.add_argument("--version-column", metavar="COLUMN",
                   help="the source's version or updated-at column (without it, only "
                   "missing and extra ids are found)")
    p.add_argument("--downstream-id-column", metavar="COLUMN",
                   help="the downstream's id column (default: --id-column)")
    p.add_argument("--downstream-version-column", metavar="COLUMN",
                   help="the downstream's version column (default: --version-column)")
    p.add_argument("--stale-when", choices=("older", "different"), default="older",
                   help="stale when the downstream version is older (default) or different")
    p.add_argument("--sample", type=int, default=10, metavar="N",
                   help="ids shown per category (default 10)")
    p.add_argument("--report", metavar="FILE", help="also write the report to FILE as "
                   "indented JSON (atomically, as --json-file)")
    p.add_argument("--stage", action="store_true",
                   help="stage a job for every missing or stale record (needs --task, --tag)")
    _add_mapping(p, required=False)
    p.add_argument("--id", dest="run_id", metavar="ID",
                   help="the repair run's id (default: TAG@<UTC time>, new every run)")
    _add_run(p)
    p.set_defaults(func=cmd_reconcile)


def _source(text: str) -> sources.Source:
    try:
        return sources.Source.parse(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _columns(text: str) -> tuple[tuple[str, str], ...]:
    try:
        return mapping_.parse_columns(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _moment(text: str) -> dt.datetime:
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO date-time: {text!r}") from None
    return moment if moment.tzinfo else moment.replace(tzinfo=dt.timezone.utc)


def _add_source(p: argparse.ArgumentParser, flag: str, what: str) -> None:
    p.add_argument(flag, required=True, type=_source, metavar="KIND:WHAT", help=what)
    p.add_argument("--source-url", metavar="URL",
                   help="Postgres URL of a table:/query: source (default --database-url)")
    p.add_argument("--partition-column", metavar="COLUMN",
                   help="read a table:/query: source in parallel, split on this numeric column")
    p.add_argument("--read-partitions", type=int, metavar="N",
                   help="parallel JDBC reads with --partition-column (default: Spark's "
                   "default parallelism)")
    p.add_argument("--schema", metavar="DDL",
                   help="a csv: source's column types, by position: 'id long, n int, text "
                   "string' (default: inferred, see docs/spark.md); a row whose value does "
                   "not fit its type is a reject (--rejects)")


def _add_mapping(p: argparse.ArgumentParser, *, required: bool) -> None:

    p.add_argument("--task", required=required, metavar="NAME",
                   help="the Celery task name, e.g. search.index_annotation")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--args", type=_columns, default=(), metavar="COLUMNS",
                       help="positional args from columns, in order: a,b,c")
    group.add_argument("--args-expr", metavar="SQL",
                       help="positional args from a Spark SQL expression returning an array")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--kwargs", type=_columns, default=(), metavar="NAME=COLUMN,...",
                       help="keyword args from columns: annotation_id=id,user_id")
    group.add_argument("--kwargs-expr", metavar="SQL",
                       help="keyword args from a Spark SQL expression returning a struct or "
                       "map, e.g. \"named_struct('annotation_id', id)\"")
    p.add_argument("--queue", help="the Celery queue (default: none given, as drain.stage: "
                   "`drain run --app` routes the jobs as the app would, else to celery)")
    p.add_argument("--priority", type=int, default=mapping_.DEFAULT_PRIORITY,
                   help=f"staged_jobs priority (default {mapping_.DEFAULT_PRIORITY}: after "
                   "the application's jobs)")
    p.add_argument("--tag", required=required, help="who staged them, e.g. backfill.reindex")
    p.add_argument("--spread", type=cli_common.duration, metavar="DURATION",
                   help="spread not_before evenly over this window (e.g. 6h), by a hash of "
                   "the key, so that the workers are not flooded")
    p.add_argument("--spread-start", type=_moment, metavar="ISO",
                   help="the window's start (default now; naive means UTC)")


def _add_run(p: argparse.ArgumentParser) -> None:
    p.add_argument("--partitions", type=int, metavar="N",
                   help="write partitions, one task and one transaction each (default: the "
                   "count of an earlier run with the same id, else 4 per Spark core)")
    p.add_argument("--master", default=os.environ.get("DRAIN_SPARK_MASTER"), metavar="URL",
                   help="Spark master (env DRAIN_SPARK_MASTER; default local[*], or the one "
                   "spark-submit gives)")
    p.add_argument("--rejects", metavar="FILE",
                   help="write records that can never become a job (NUL in text, NaN) to FILE "
                   "as JSON lines and stage the rest (default: the first one fails the run "
                   "before anything is staged)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.add_argument("--json-file", metavar="PATH",
                   help="also write that JSON object to PATH (atomically, only on success): "
                   "under spark-submit, whose stdout also carries drain's errors, the place "
                   "to read the result from (docs/spark.md)")


# -- handlers ---------------------------------------------------------------------------


def _mapping(args: argparse.Namespace, key: str) -> mapping_.Mapping:
    return mapping_.Mapping(
        task_name=args.task, key=key, tag=args.tag, args=args.args, args_expr=args.args_expr,
        kwargs=args.kwargs, kwargs_expr=args.kwargs_expr, queue=args.queue,
        priority=args.priority, spread=args.spread, spread_start=args.spread_start,
    )


def _partitions(args: argparse.Namespace, run_id: str, spark: SparkSession) -> int:
    """--partitions, or the count an earlier run of this id used, or 4 per core."""
    from drain.spark import backfill, ledger  # noqa: PLC0415

    if args.partitions is not None:
        return int(args.partitions)
    with contextlib.suppress(DatabaseUnavailable):
        earlier = ledger.earlier_partitions(args.database_url, run_id)
        if earlier is not None:
            return earlier
    return backfill.default_partitions(spark)


@contextlib.contextmanager
def _spark(args: argparse.Namespace, app_name: str) -> Iterator[SparkSession]:
    from drain.spark import session  # noqa: PLC0415

    # py4j logs every closed gateway connection at INFO, and a lost JVM with tracebacks;
    # pyspark logs every analysis error it raises (as JSON, on its own handler): drain
    # reports them in one line.
    verbose = bool(getattr(args, "verbose", False))
    errors.quiet_py4j(verbose)
    if not verbose:
        for name in ("DataFrameQueryContextLogger", "SQLQueryContextLogger"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    spark, created = session.get_session(args.master, app_name, verbose)
    try:
        with spark_errors():
            yield spark
    except errors.SparkJvmLost:
        created = False  # nothing left to stop
        raise
    finally:
        if created:
            with spark_errors():
                spark.stop()


def _progress(args: argparse.Namespace, spark: SparkSession) -> bool:
    from drain.spark import session  # noqa: PLC0415

    return not args.no_progress and sys.stderr.isatty() and session.is_local(spark)


def _read(spark: SparkSession, args: argparse.Namespace) -> Any:
    url = args.source_url if args.source_url is not None else args.database_url
    options = sources.JdbcOptions(database_url=url, partition_column=args.partition_column,
                                  num_partitions=args.read_partitions)
    return sources.read(spark, args.source, options, schema=args.schema)


def cmd_backfill(args: argparse.Namespace) -> int:
    """``drain backfill``: dry run, or stage and print the summary."""
    from drain.spark import backfill  # noqa: PLC0415

    run_id = args.run_id or args.tag
    m = _mapping(args, args.key)
    options = backfill.Options(database_url=args.database_url, run_id=run_id,
                               partitions=args.partitions or 1, where=args.where,
                               rejects_file=args.rejects)
    backfill.check(m, options)  # before Spark starts
    output.check_writable(args.json_file, "--json-file")
    with _spark(args, "drain backfill") as spark:
        options = dataclasses.replace(
            options, partitions=_partitions(args, run_id, spark), progress=_progress(args, spark),
            partitions_explicit=args.partitions is not None,
        )
        df = _read(spark, args)
        if args.dry_run:
            plan = backfill.dry_run(df, m, options, args.sample)
            output.emit({"dry_run": True, **plan}, _dry_run_text(plan), as_json=args.json,
                        json_file=args.json_file)
            return 0
        result = backfill.run(spark, df, m, options)
    output.emit(result.as_dict(), result.text(), as_json=args.json, json_file=args.json_file)
    return 0


def _dry_run_text(plan: dict[str, Any]) -> str:
    shown = len(plan["sample"])
    committed = plan["committed_partitions"]
    earlier = (f" ({committed} committed by earlier runs with {plan['committed_rows']:,} "
               "job(s), skipped)") if committed else ""
    if plan["ledger_unread"]:
        earlier = f" (the ledger was not read: {plan['ledger_unread']})"
    lines = [f"dry run: backfill {plan['backfill_id']!r} would stage {plan['count']:,} job(s) "
             f"in {plan['partitions']} partitions{earlier}"
             + (f"; the first {shown} by key:" if shown else "")]
    lines += ["  " + json.dumps(job, sort_keys=True, default=str) for job in plan["sample"]]
    if plan["rejected"]:
        refused = plan["rejected_sample"]
        lines.append(f"and would refuse {plan['rejected']:,} record(s) (a run lists them in "
                     f"{plan['rejects_file']})"
                     + (f"; the first {len(refused)} by key:" if refused else ""))
        lines += ["  " + json.dumps(row, sort_keys=True) for row in refused]
    return "\n".join(lines)


def cmd_reconcile(args: argparse.Namespace) -> int:
    """``drain reconcile``: report; with --stage, stage the repairs."""
    from drain.spark import backfill, reconcile  # noqa: PLC0415

    sides = reconcile.Sides(
        id_column=args.id_column, version_column=args.version_column,
        downstream_id_column=args.downstream_id_column,
        downstream_version_column=args.downstream_version_column, stale_when=args.stale_when,
    )
    sides.validate()
    m: mapping_.Mapping | None = None
    options: backfill.Options | None = None
    if args.stage:
        if not args.task or not args.tag:
            raise UsageError(
                "--stage needs --task and --tag (e.g. reconcile.search_index)")
        now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        run_id = args.run_id or f"{args.tag}@{now}"
        m = _mapping(args, f"`{args.id_column}`")
        options = backfill.Options(database_url=args.database_url, run_id=run_id,
                                   partitions=args.partitions or 1, rejects_file=args.rejects)
        backfill.check(m, options)  # before Spark starts
    output.check_writable(args.json_file, "--json-file")
    output.check_writable(args.report, "--report")
    with _spark(args, "drain reconcile") as spark:
        from pyspark import StorageLevel  # noqa: PLC0415

        truth = _read(spark, args)
        downstream_url = (args.downstream_url if args.downstream_url is not None
                          else args.database_url)
        downstream = sources.read(spark, args.downstream, sources.JdbcOptions(
            database_url=downstream_url, partition_column=args.downstream_partition_column,
            num_partitions=args.read_partitions))
        # Cached: the report and the staged repairs come from the same comparison.
        compared = reconcile.compare(truth, downstream, sides).persist(
            StorageLevel.MEMORY_AND_DISK
        )
        staged: str | None = None
        try:
            rep = reconcile.report(compared, args.sample)
            if m is not None and options is not None:
                fixes = reconcile.repairs(compared, truth.columns)
                options = dataclasses.replace(
                    options, partitions=_partitions(args, options.run_id, spark),
                    progress=_progress(args, spark),
                    partitions_explicit=args.partitions is not None,
                )
                result = backfill.run(spark, fixes, m, options)
                rep["staged"] = {**result.as_dict(), "tag": m.tag, "task": m.task_name}
                staged = result.text().replace("backfill", "repairs", 1)
        finally:
            compared.unpersist()
    text = reconcile.table(rep) + (f"\n{staged}" if staged else "")
    output.emit(rep, text, as_json=args.json, json_file=args.json_file)
    if args.report:
        output.write_json(args.report, rep, "--report", indent=2)
    return 0


# -- Spark's errors as drain's: drain.spark.errors ---------------------------------

spark_errors = errors.spark_errors
describe = errors.describe


# -- python -m drain.spark ----------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """A ``drain`` parser with only the Spark commands (for ``python -m drain.spark``)."""
    parser = argparse.ArgumentParser(
        prog="drain", description="drain's Spark commands: backfill and reconcile.",
        epilog=_EPILOG,
    )
    parser.add_argument("--version", action=version.VersionAction)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="debug logging and tracebacks on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_parsers(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``backfill`` or ``reconcile`` as ``drain`` would: one-line errors, exit codes."""

    args = build_parser().parse_args(argv)
    cli_common.configure_logging(args.verbose)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        return int(cli_common.Exit.OK)
    except Exception as exc:
        code = next((c for t, c in cli_common.EXIT_CODES if isinstance(exc, t)),
                    cli_common.Exit.ERROR)
        if args.verbose:
            logging.getLogger("drain").exception("drain %s failed", args.command)
        text = str(exc) if isinstance(exc, DrainError) else f"{type(exc).__name__}: {exc}"
        text = text.strip().splitlines()[0] if text.strip() else text
        from drain.settings import urls  # noqa: PLC0415

        print(f"drain: error: {urls.scrub(text, cli_common.secrets_in(args))}", file=sys.stderr)
        return int(code)
