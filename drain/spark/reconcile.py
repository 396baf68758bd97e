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
    (NULL for extra ids), with ``_id`` the id of either side."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    sides.validate()
    _require(truth, sides.id_column, "the source", "--id-column")
    _require(downstream, sides.downstream_id, "the downstream", "--downstream-id-column")
    id_type = truth.schema[sides.id_column].dataType
    t = truth.withColumn("_t_id", F.col(sides.id_column))
    d_cols = [F.col(sides.downstream_id).cast(id_type).alias("_d_id")]
    version = sides.version_column
    if version is not None:
        _require(truth, version, "the source", "--version-column")
        d_version = sides.downstream_version
        assert d_version is not None
        _require(downstream, d_version, "the downstream", "--downstream-version-column")
        t = t.withColumn("_t_version", F.col(version))
        d_cols.append(F.col(d_version).cast(truth.schema[version].dataType).alias("_d_version"))
    d = downstream.select(*d_cols)
    if version is not None:  # one row per id downstream: its newest version
        d = d.groupBy("_d_id").agg(F.max("_d_version").alias("_d_version"))
    else:
        d = d.dropDuplicates(["_d_id"])
    joined = t.join(d, t["_t_id"] == d["_d_id"], "full_outer")
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
    return joined.withColumn("_status", status).withColumn(
        "_id", F.coalesce(F.col("_t_id"), F.col("_d_id"))
    )


def report(compared: DataFrame, sample: int) -> dict[str, Any]:
    """Counts per status and the first ``sample`` ids (in id order) of each problem."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    counts = {status: 0 for status in STATUSES}
    for row in compared.groupBy("_status").count().collect():
        counts[row["_status"]] = int(row["count"])
    out: dict[str, Any] = {
        "source_records": counts["missing"] + counts["stale"] + counts["ok"],
        "downstream_records": counts["stale"] + counts["ok"] + counts["extra"],
        "ok": counts["ok"],
    }
    for status in ("missing", "stale", "extra"):
        ids = []
        if counts[status] and sample > 0:
            ids = [
                _plain(r["_id"])
                for r in compared.filter(F.col("_status") == status)
                .select("_id").orderBy("_id").limit(sample).collect()
            ]
        out[status] = {"count": counts[status], "sample": ids}
    return out


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
        sample = ", ".join(str(i) for i in entry["sample"])
        more = ", ..." if entry["count"] > len(entry["sample"]) else ""
        lines.append(f"  {label:<11}{entry['count']:>10,}" + (f"   e.g. {sample}{more}"
                                                               if sample else ""))
    lines.append(f"  {'up to date':<11}{rep['ok']:>10,}")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    """An id as JSON takes it."""
    return value if isinstance(value, (int, float, str)) or value is None else str(value)


def _require(df: DataFrame, column: str, side: str, flag: str) -> None:
    if column not in df.columns:
        raise ConfigError(
            f"{side} has no column {column!r} ({flag}); its columns: {', '.join(df.columns)}"
        )
