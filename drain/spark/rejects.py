"""Records that can never become a job, found before any COPY.

:func:`reason` is a Spark SQL column: NULL for a record that can be staged,
else why not, in :func:`drain.stage`'s words (drain/staging_values.py):

* args or kwargs holding a NUL character (``\\u0000`` in their JSON): "args for
  TASK contain a NUL character, which jsonb refuses";
* a NaN or infinite float among the args or kwargs, at any depth (in a struct,
  an array, a map's values), which JSON cannot hold (Spark would write the
  string ``"NaN"``): "kwargs for TASK are not
  JSON-serialisable: Out of range float values are not JSON compliant: nan; ...";
* a malformed source row (a CSV row with too few or too many fields, or a value
  its column's type cannot hold, a JSON line that does not parse, a Parquet
  string that is not UTF-8: drain.spark.sources), by the source's reason in the
  column ``mapping.MALFORMED``; a JSON line may have no key (and so no
  partition): its line names it.

:func:`check` runs it over the source before the write (a pass without a
shuffle, and only when the mapping has a string or float value): by default
the first refused record ends the run, naming its key and partition, before
anything is staged; with ``--rejects FILE`` every refused record is written to
FILE (JSON lines: partition, key, reason) and the rest is staged. ``--dry-run``
makes the same split (:func:`split`): it counts only the records a run would
stage, refuses as a run would without ``--rejects``, and with it reports the
refused records without writing FILE. A resumed
backfill checks only the partitions it stages (those committed earlier were
checked by the run that committed them), so its FILE lists only their records.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from drain.errors import StagingError
from drain.spark import mapping as mapping_

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame

#: A ``\u0000`` escape preceded by an even number of backslashes (staging_values._JSON_NUL).
JSON_NUL = r"(?<!\\)(?:\\\\)*\\u0000"
_NOT_JSON = (
    "{what} for {task} are not JSON-serialisable: Out of range float values are not JSON "
    "compliant: {value}; jsonb stores no NaN or infinity"
)


def reason(df: DataFrame, m: mapping_.Mapping) -> Column | None:
    """Why a record of ``df`` cannot be staged (NULL: it can); None when no record can
    be refused (no string or float among the mapping's values)."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    checks: list[Column] = []
    if mapping_.MALFORMED in df.columns:
        checks.append(F.col(mapping_.MALFORMED))
        df = df.drop(mapping_.MALFORMED)
    for what, json_text, values in (
        ("args", mapping_.args_json(df, m), _values(m.args, m.args_expr)),
        ("kwargs", mapping_.kwargs_json(df, m), _values(m.kwargs, m.kwargs_expr)),
    ):
        if not values:
            continue
        types = [df.select(F.expr(v)).schema.fields[0].dataType for v in values]
        if any("string" in t.simpleString() for t in types):
            checks.append(F.when(
                json_text.rlike(JSON_NUL),
                F.lit(f"{what} for {m.task_name} contain a NUL character, which jsonb refuses"),
            ))
        for value, data_type in zip(values, types, strict=True):
            found = first_bad_float(F.expr(value), data_type)
            if found is None:
                continue
            shown = F.when(F.isnan(found), F.lit("nan")).when(
                found > 0, F.lit("inf")).otherwise(F.lit("-inf"))
            head, _, tail = _NOT_JSON.format(what=what, task=m.task_name,
                                             value="\0").partition("\0")
            checks.append(F.when(found.isNotNull(), F.concat(F.lit(head), shown, F.lit(tail))))
    return F.coalesce(*checks) if checks else None


def first_bad_float(value: Column, data_type: Any) -> Column | None:
    """The first NaN or infinite float in ``value`` (a double; NULL: none), looking
    into structs, arrays and map values; None when its type holds no float."""
    from pyspark.sql import functions as F  # noqa: PLC0415
    from pyspark.sql import types as T  # noqa: PLC0415

    if isinstance(data_type, (T.DoubleType, T.FloatType)):
        return F.when(F.isnan(value) | (F.abs(value) == F.lit(float("inf"))),
                      value.cast("double"))
    if isinstance(data_type, T.StructType):
        found = [c for f in data_type.fields
                 if (c := first_bad_float(value.getField(f.name), f.dataType)) is not None]
        return F.coalesce(*found) if len(found) > 1 else (found[0] if found else None)
    if isinstance(data_type, (T.ArrayType, T.MapType)):
        inner = (data_type.elementType if isinstance(data_type, T.ArrayType)
                 else data_type.valueType)
        if first_bad_float(F.lit(None).cast(inner), inner) is None:
            return None
        items = value if isinstance(data_type, T.ArrayType) else F.map_values(value)

        def bad(item: Column) -> Column:
            found = first_bad_float(item, inner)
            assert found is not None
            return found

        return F.try_element_at(F.filter(F.transform(items, bad), lambda x: x.isNotNull()),
                                F.lit(1))
    return None


def _values(columns: tuple[tuple[str, str], ...], expression: str | None) -> list[str]:
    if expression:
        return [expression]
    return [f"`{column}`" if column.isidentifier() else column for _, column in columns]


def split(df: DataFrame, m: mapping_.Mapping,
          partitions: int) -> tuple[DataFrame, DataFrame | None]:
    """``df``'s records that can be staged, and the refused ones as ``partition``,
    ``key`` and ``reason`` (None when the mapping can refuse no record); lazy."""
    from pyspark.sql import functions as F  # noqa: PLC0415

    why = reason(df, m)
    if why is None:
        return df.drop(mapping_.MALFORMED), None
    key = F.expr(m.key)
    refused = df.select(  # a malformed line may have no key, and so no partition
        F.when(key.isNotNull(), mapping_.partition_of(key, partitions)).alias("partition"),
        key.cast("string").alias("key"), why.alias("reason"),
    ).filter(F.col("reason").isNotNull())
    return df.filter(why.isNull()).drop(mapping_.MALFORMED), refused


def stop_at_first(refused: DataFrame) -> None:
    """Raise StagingError for the first refused record, if there is one (no --rejects)."""
    first = refused.limit(1).collect()
    if first:
        row = first[0]
        which = (f"record {row['key']} (partition {row['partition']}): "
                 if row["key"] is not None else "")
        raise StagingError(
            f"{which}{row['reason']}; nothing was staged (--rejects FILE stages the other "
            "records and lists the refused ones in FILE)"
        )


def check(df: DataFrame, m: mapping_.Mapping, partitions: int,
          rejects_file: str | None) -> tuple[DataFrame, int]:
    """``df`` without the records that cannot be staged, and how many those were.

    Without ``rejects_file`` a refused record raises StagingError (naming its key
    and partition) before anything is staged.
    """
    records, refused = split(df, m, partitions)
    if refused is None:
        return records, 0
    everything = df.drop(mapping_.MALFORMED)  # no record refused: the write skips the check
    if rejects_file is None:
        stop_at_first(refused)
        return everything, 0
    count = 0
    with open(rejects_file, "w", encoding="utf-8") as out:
        for row in refused.toLocalIterator():
            out.write(json.dumps(row.asDict(), sort_keys=True) + "\n")
            count += 1
    return (records if count else everything), count
