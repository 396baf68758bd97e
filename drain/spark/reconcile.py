"""``drain reconcile``: find the records whose downstream copy is missing or stale.

The source of truth has an id and (optionally) a version column (an
``updated_at``, a revision number...); the downstream's view (a table, or
files exported from the downstream system) has the same. A full outer join on
the id sorts every id into:

* ``missing``: in the source, not downstream;
* ``stale``: in both, and the downstream version is older than the source's
  (``--stale-when different``: not equal), or the downstream has none;
* ``extra``: downstream only (reported; no job repairs it);
* ``ok``: the rest.

Ids are counted once per side, whatever its rows: a NULL id is counted apart
on its side (``null_ids``), compared with nothing and never staged; an id on
several rows of a side is counted once, as its newest version (the source's
newest row is the one a repair stages), and reported under
``duplicate_ids`` (ids and rows). A downstream id that the source's id type
cannot hold (``"x7"`` where the source's ids are bigint) is counted apart too
(``unreadable_ids``, with a sample of their text), compared with nothing.
``source_records`` and ``downstream_records`` count rows.

With ``--stage``, the missing and stale records go through the backfill's
mapping and idempotent writer, under their own tag and run id.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from drain.errors import ConfigError

if TYPE_CHECKING:
    from pyspark.sql import DataFrame

STATUSES = ("missing", "stale", "extra", "ok")
REPAIRED = ("missing", "stale")
#: The statuses of a row whose id is NULL, on the source's side or the downstream's.
NULLS = ("null_source", "null_downstream")
#: The status of a downstream row whose id the source's id type cannot hold ("x7" for a
#: bigint id): counted and sampled (its text, in ``_d_text``), compared with nothing.
UNREADABLE = "unreadable_downstream"


@dataclasses.dataclass(frozen=True)
class Sides:
    """Which columns hold the id and the version on each side."""

    id_column: str = "id"
    version_column: str | None = None
    downstream_id_column: str | None = None
    downstream_version_column: str | None = None
    #: "older": stale when downstream < source; "different": when they differ.
    stale_when: str = "older"

    @property
    def downstream_id(self) -> str:
        return self.downstream_id_column or self.id_column

    @property
    def downstream_version(self) -> str | None:
        return self.downstream_version_column or self.version_column

    def validate(self) -> None:
        if self.stale_when not in ("older", "different"):
            raise ConfigError(f"--stale-when must be older or different, not {self.stale_when!r}")
        if self.downstream_version_column and not self.version_column:
            raise ConfigError("--downstream-version-column needs --version-column")


def compare(truth: DataFrame, downstream: DataFrame, sides: Sides) -> DataFrame:
    """Every id of either side with its ``_status``; the source's columns are kept
    (NULL for extra ids), with ``_id`` the id of either side and ``_t_rows`` /
    ``_d_rows`` the rows holding it on each side. A row with a NULL id is a row of its
    own, with status ``null_source`` or ``null_downstream``; an id on several rows of
    the source is kept once, its row of the newest version."""
    from pyspark.sql import Window  # noqa: PLC0415
    from pyspark.sql import functions as F  # noqa: PLC0415

    sides.validate()
    _require(truth, sides.id_column, "the source", "--id-column")
    _require(downstream, sides.downstream_id, "the downstream", "--downstream-id-column")
    id_type = truth.schema[sides.id_column].dataType
    t = truth.withColumn("_t_id", F.col(sides.id_column))
    d_raw = F.col(sides.downstream_id)
    d_id = d_raw.try_cast(id_type)
    d_cols = [d_id.alias("_d_id"),
              F.when(d_raw.isNotNull() & d_id.isNull(), d_raw.cast("string")).alias("_d_text")]
    version = sides.version_column
    if version is not None:
        _require(truth, version, "the source", "--version-column")
        d_version = sides.downstream_version
        assert d_version is not None
        _require(downstream, d_version, "the downstream", "--downstream-version-column")
        t = t.withColumn("_t_version", F.col(version))
        d_cols.append(F.col(d_version).cast(truth.schema[version].dataType).alias("_d_version"))
    d = downstream.select(*d_cols)
    # One row per id on each side, with how many rows held it: the newest version.
    by_id = Window.partitionBy("_t_id")
    newest = by_id.orderBy(F.col("_t_version").desc_nulls_last() if version is not None
                           else F.lit(0))
    t_ids = (
        t.filter(F.col("_t_id").isNotNull())
        .withColumn("_t_rows", F.count(F.lit(1)).over(by_id))
        .withColumn("_t_rank", F.row_number().over(newest))
        .filter(F.col("_t_rank") == 1).drop("_t_rank")
    )
    aggregates = [F.count(F.lit(1)).alias("_d_rows")]
    if version is not None:
        aggregates.append(F.max("_d_version").alias("_d_version"))
    d_ids = d.filter(F.col("_d_id").isNotNull()).groupBy("_d_id").agg(*aggregates)
    joined = t_ids.join(d_ids, t_ids["_t_id"] == d_ids["_d_id"], "full_outer")
    stale = F.lit(False)
    if version is not None:
        tv, dv = F.col("_t_version"), F.col("_d_version")
        differs = dv < tv if sides.stale_when == "older" else ~tv.eqNullSafe(dv)
        stale = (dv.isNull() & tv.isNotNull()) | F.coalesce(differs, F.lit(False))
    status = (
        F.when(F.col("_d_id").isNull(), F.lit("missing"))
        .when(F.col("_t_id").isNull(), F.lit("extra"))
        .when(stale, F.lit("stale"))
        .otherwise(F.lit("ok"))
    )
    compared = joined.withColumn("_status", status)
    null_rows = (
        t.filter(F.col("_t_id").isNull()).withColumn("_status", F.lit("null_source"))
        .withColumn("_t_rows", F.lit(1).cast("long")),
        d.filter(F.col("_d_id").isNull()).withColumn("_status", F.when(
            F.col("_d_text").isNull(), F.lit("null_downstream")).otherwise(F.lit(UNREADABLE)))
        .withColumn("_d_rows", F.lit(1).cast("long")),
    )
    for rows in null_rows:
        compared = compared.unionByName(rows, allowMissingColumns=True)
    return compared.withColumn(
        "_id", F.coalesce(F.col("_t_id"), F.col("_d_id"))
    ).withColumn("_t_rows", F.coalesce(F.col("_t_rows"), F.lit(0))).withColumn(
        "_d_rows", F.coalesce(F.col("_d_rows"), F.lit(0)))


def report(compared: DataFrame, sample: int) -> dict[str, Any]:
    """Counts per status and the first ``sample`` ids (in id order) of each problem;
    NULL ids (rows) and duplicated ids (ids, their rows, a sample) of each side."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    counts = {status: 0 for status in (*STATUSES, *NULLS, UNREADABLE)}
    for row in compared.groupBy("_status").count().collect():
        counts[row["_status"]] = int(row["count"])
    totals = compared.agg(
        F.sum("_t_rows").alias("t_rows"), F.sum("_d_rows").alias("d_rows"),
        F.count_if(F.col("_t_rows") > 1).alias("t_dup"),
        F.sum(F.when(F.col("_t_rows") > 1, F.col("_t_rows"))).alias("t_dup_rows"),
        F.count_if(F.col("_d_rows") > 1).alias("d_dup"),
        F.sum(F.when(F.col("_d_rows") > 1, F.col("_d_rows"))).alias("d_dup_rows"),
    ).collect()[0]
    out: dict[str, Any] = {
        "source_records": int(totals["t_rows"] or 0),
        "downstream_records": int(totals["d_rows"] or 0),
        "ok": counts["ok"],
        "null_ids": {"source": counts["null_source"],
                     "downstream": counts["null_downstream"]},
        "duplicate_ids": {
            side: {"count": int(totals[f"{p}_dup"] or 0), "rows": int(totals[f"{p}_dup_rows"] or 0),
                   "sample": _sample(compared, F.col(f"_{p}_rows") > 1, sample)
                   if totals[f"{p}_dup"] else []}
            for side, p in (("source", "t"), ("downstream", "d"))
        },
    }
    out["unreadable_ids"] = {
        "count": counts[UNREADABLE], "type": compared.schema["_id"].dataType.simpleString(),
        "sample": _sample(compared, F.col("_status") == UNREADABLE, sample, "_d_text")
        if counts[UNREADABLE] else [],
    }
    for status in ("missing", "stale", "extra"):
        ids = (_sample(compared, F.col("_status") == status, sample)
               if counts[status] else [])
        out[status] = {"count": counts[status], "sample": ids}
    return out


def _sample(compared: DataFrame, condition: Any, sample: int, column: str = "_id") -> list[Any]:
    if sample <= 0:
        return []
    return [_plain(r[column]) for r in
            compared.filter(condition).select(column).orderBy(column).limit(sample).collect()]


def repairs(compared: DataFrame, truth_columns: list[str]) -> DataFrame:
    """The source's records that need a job: missing or stale downstream."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    return compared.filter(F.col("_status").isin(*REPAIRED)).select(
        *[F.col(f"`{c}`") for c in truth_columns]
    )


def table(rep: dict[str, Any]) -> str:
    """The report as a few lines for a terminal."""
    lines = [
        f"reconcile: {rep['source_records']:,} source record(s), "
        f"{rep['downstream_records']:,} downstream record(s)"
    ]
    for status, label in (("missing", "missing"), ("stale", "stale"), ("extra", "extra")):
        entry = rep[status]
        lines.append(f"  {label:<11}{entry['count']:>10,}" + _examples(entry))
    lines.append(f"  {'up to date':<11}{rep['ok']:>10,}")
    nulls = rep["null_ids"]
    if nulls["source"] or nulls["downstream"]:
        lines.append(f"  NULL id: {nulls['source']:,} source row(s), {nulls['downstream']:,} "
                     "downstream row(s) (compared with nothing, never staged)")
    unreadable = rep["unreadable_ids"]
    if unreadable["count"]:
        lines.append(f"  unreadable: {unreadable['count']:,} downstream id(s) not a "
                     f"{unreadable['type']} like the source's (compared with nothing)"
                     + _examples(unreadable))
    for side, dup in rep["duplicate_ids"].items():
        if dup["count"]:
            lines.append(f"  duplicated: {dup['count']:,} {side} id(s) on {dup['rows']:,} rows "
                         "(each counted once, as its newest version)" + _examples(dup))
    return "\n".join(lines)


def _examples(entry: dict[str, Any]) -> str:
    """``"   e.g. 3, 10, ..."``: an entry's sample, and whether there are more."""
    if not entry["sample"]:
        return ""
    more = ", ..." if entry["count"] > len(entry["sample"]) else ""
    return f"   e.g. {', '.join(str(i) for i in entry['sample'])}{more}"


def _plain(value: Any) -> Any:
    """An id as JSON takes it."""
    return value if isinstance(value, (int, float, str)) or value is None else str(value)


def _require(df: DataFrame, column: str, side: str, flag: str) -> None:
    if column not in df.columns:
        raise ConfigError(
            f"{side} has no column {column!r} ({flag}); its columns: {', '.join(df.columns)}"
        )
