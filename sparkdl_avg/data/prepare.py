"""From the user's DataFrame to `num_workers` balanced, validated partitions (Spark side).

One aggregation job validates everything (columns, nulls/NaN, feature width, label range) and
counts rows per input partition; those counts number the rows globally, and a hash key chosen
per worker sends row g to partition `g % num_workers` in a single shuffle. Training then reads
each partition once through `mapInArrow`.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl_avg._errors import DataError
from sparkdl_avg.data.columns import EVAL, FEATURES, INDEX, LABEL, SPLIT, TRAIN
from sparkdl_avg.data.order import partition_sizes

_NUMERIC = (T.ByteType, T.ShortType, T.IntegerType, T.LongType, T.FloatType, T.DoubleType,
            T.DecimalType)
_INTEGRAL = (T.ByteType, T.ShortType, T.IntegerType, T.LongType)


@dataclass(frozen=True, slots=True)
class PreparedData:
    """Validated data, partitioned one partition per worker, and what was learned about it."""

    frame: DataFrame
    num_features: int
    train_sizes: list[int]
    eval_sizes: list[int]
    integral_labels: bool
    label_min: float
    label_max: float
    fractional_labels: int


def prepare(
    train_df: DataFrame,
    eval_df: DataFrame | None,
    *,
    features_col: str | Sequence[str],
    label_col: str,
    num_workers: int,
    double_precision: bool,
) -> PreparedData:
    element = T.DoubleType() if double_precision else T.FloatType()
    sides = [_normalise(train_df, "train_df", features_col, label_col, element)]
    if eval_df is not None:
        sides.append(_normalise(eval_df, "eval_df", features_col, label_col, element))
    integral = sides[0][1]
    if eval_df is not None and sides[1][1] != integral:
        raise DataError(
            f"label column {label_col!r} is integral in one of train_df/eval_df and "
            "fractional in the other; cast both to the same type"
        )
    label_type = T.LongType() if integral else T.DoubleType()
    # Rows are numbered on each side before the union, so both sides count from 0 however
    # Spark lays out the union's partitions.
    frames = [
        frame.select(F.col(FEATURES), F.col(LABEL).cast(label_type).alias(LABEL),
                     F.lit(split).cast(T.ByteType()).alias(SPLIT),
                     F.spark_partition_id().alias("_pid"),
                     F.monotonically_increasing_id().alias("_mid"))
        for split, (frame, _) in enumerate(sides)
    ]
    numbered = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    stats = _validate(numbered, features_col, label_col, element, has_eval=eval_df is not None)

    offsets, stride = _row_offsets(stats["per_partition"])
    local_pos = F.col("_mid") - F.shiftleft(F.col("_pid").cast(T.LongType()), 33)
    slot = F.col(SPLIT).cast(T.IntegerType()) * stride + F.col("_pid") + 1
    row = F.element_at(F.array(*[F.lit(o) for o in offsets]), slot) + local_pos
    keys = _partition_keys(num_workers)
    key = F.element_at(F.array(*[F.lit(k) for k in keys]),
                       (row % num_workers).cast(T.IntegerType()) + 1)
    frame = (
        numbered.withColumn(INDEX, row)
        .withColumn("_key", key)
        .repartition(num_workers, "_key")
        .select(FEATURES, LABEL, INDEX, SPLIT)
    )
    return PreparedData(
        frame=frame,
        num_features=stats["num_features"],
        train_sizes=partition_sizes(stats["rows"][TRAIN], num_workers),
        eval_sizes=partition_sizes(stats["rows"][EVAL], num_workers),
        integral_labels=integral,
        label_min=stats["label_min"],
        label_max=stats["label_max"],
        fractional_labels=stats["fractional_labels"],
    )


def _column(df: DataFrame, name: object, argument: str, frame_name: str) -> T.StructField:
    if not isinstance(name, str):
        raise DataError(f"{argument} must be a column name, got {name!r}")
    fields = {f.name: f for f in df.schema.fields}
    if name not in fields:
        hint = difflib.get_close_matches(name, list(fields), n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        raise DataError(
            f"{frame_name} has no column {name!r} ({argument}){did_you_mean} "
            f"Columns: {sorted(fields)}"
        )
    return fields[name]


def _normalise(
    df: DataFrame, frame_name: str, features_col: str | Sequence[str], label_col: str,
    element: T.DataType,
) -> tuple[DataFrame, bool]:
    """Features as array<element>, label as-is; also says whether labels are integral."""
    features = features_column(df, features_col, frame_name, element)
    label_field = _column(df, label_col, "label_col", frame_name)
    if not isinstance(label_field.dataType, _NUMERIC) or isinstance(
        label_field.dataType, T.BooleanType
    ):
        raise DataError(
            f"{frame_name} label column {label_col!r} has type "
            f"{label_field.dataType.simpleString()}; labels must be int or float"
        )
    integral = isinstance(label_field.dataType, _INTEGRAL)
    frame = df.select(features.alias(FEATURES), F.col(f"`{label_col}`").alias(LABEL))
    return frame, integral


def features_column(df: DataFrame, features_col: str | Sequence[str], frame_name: str,
                    element: T.DataType) -> Column:
    """The features as one array<element> column: from an array column, a pyspark.ml vector,
    or a list of numeric columns. Raises DataError naming what does not fit."""
    if not isinstance(df, DataFrame):
        raise DataError(f"{frame_name} must be a pyspark DataFrame, got {type(df).__name__}")
    if isinstance(features_col, str):
        field = _column(df, features_col, "features_col", frame_name)
        col = F.col(f"`{features_col}`")
        dtype = field.dataType
        if isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, _NUMERIC):
            features = col.cast(T.ArrayType(element))
        elif type(dtype).__name__ == "VectorUDT":
            from pyspark.ml.functions import vector_to_array

            dtype_name = "float64" if isinstance(element, T.DoubleType) else "float32"
            features = vector_to_array(col, dtype=dtype_name)
        else:
            raise DataError(
                f"{frame_name} column {features_col!r} has type {dtype.simpleString()}; features "
                "must be array<float|double|int>, a pyspark.ml.linalg vector, or a list of "
                "numeric column names"
            )
    elif isinstance(features_col, Sequence) and features_col:
        parts: list[Column] = []
        for name in features_col:
            field = _column(df, name, "features_col", frame_name)
            if not isinstance(field.dataType, _NUMERIC):
                raise DataError(
                    f"{frame_name} feature column {name!r} has type "
                    f"{field.dataType.simpleString()}; feature columns must be numeric"
                )
            parts.append(F.col(f"`{name}`").cast(element))
        features = F.array(*parts)
    else:
        raise DataError(f"features_col must be a column name or a non-empty list, got "
                        f"{features_col!r}")
    return features


def bad_features(element: T.DataType) -> Column:
    """True for rows whose features are null or hold a null, NaN or infinite element.

    Spark generates code for `array_contains` (NaN equals NaN there), not for a lambda
    through `exists`, which it interprets element by element: the validation over 2M rows
    of 40 features took 0.87 s this way against 1.86 s, warm medians
    (`bench/results/validation_scan-20261125T210301Z.json`).
    `array_contains` is null for a null array, or for one holding a null and none of the
    values: both count as bad."""
    nan, inf = F.lit(float("nan")).cast(element), F.lit(float("inf")).cast(element)
    found = (F.array_contains(FEATURES, nan) | F.array_contains(FEATURES, inf)
             | F.array_contains(FEATURES, -inf))
    return F.coalesce(found, F.lit(True))


def _validate(numbered: DataFrame, features_col: object, label_col: str,
              element: T.DataType, *, has_eval: bool):
    bad_feature = bad_features(element)
    label = F.col(LABEL).cast(T.DoubleType())
    bad_label = label.isNull() | F.isnan(label) | (F.abs(label) == float("inf"))
    rows = numbered.groupBy(SPLIT, "_pid").agg(
        F.count(F.lit(1)).alias("rows"),
        F.sum(bad_feature.cast(T.LongType())).alias("bad_features"),
        F.sum(bad_label.cast(T.LongType())).alias("bad_labels"),
        F.min(F.size(FEATURES)).alias("min_width"),
        F.max(F.size(FEATURES)).alias("max_width"),
        F.min(label).alias("label_min"),
        F.max(label).alias("label_max"),
        F.sum((label != F.floor(label)).cast(T.LongType())).alias("fractional_labels"),
    ).collect()
    names = {TRAIN: "train_df", EVAL: "eval_df"}
    total = {TRAIN: 0, EVAL: 0}
    for r in rows:
        total[r[SPLIT]] += r["rows"]
    if total[TRAIN] == 0:
        raise DataError("train_df is empty")
    if has_eval and total[EVAL] == 0:
        raise DataError("eval_df is empty; pass eval_df=None to skip evaluation")
    for split in (TRAIN, EVAL):
        mine = [r for r in rows if r[SPLIT] == split]
        if not mine:
            continue
        bad_f = sum(r["bad_features"] or 0 for r in mine)
        if bad_f:
            raise DataError(
                f"{names[split]} has {bad_f} rows whose features ({features_col!r}) are null or "
                "contain null/NaN/infinite values; filter or impute them first"
            )
        bad_l = sum(r["bad_labels"] or 0 for r in mine)
        if bad_l:
            raise DataError(
                f"{names[split]} has {bad_l} rows whose label ({label_col!r}) is null, NaN or "
                "infinite; filter them first"
            )
    widths = {w for r in rows for w in (r["min_width"], r["max_width"])}
    if len(widths) != 1:
        raise DataError(
            f"rows have different numbers of features ({features_col!r}): "
            f"from {min(widths)} to {max(widths)}; every row needs the same width"
        )
    width = widths.pop()
    if width == 0:
        raise DataError(f"features ({features_col!r}) are empty arrays")
    return {
        "per_partition": [(r[SPLIT], r["_pid"], r["rows"]) for r in rows],
        "rows": total,
        "num_features": width,
        "label_min": min(r["label_min"] for r in rows),
        "label_max": max(r["label_max"] for r in rows),
        "fractional_labels": sum(r["fractional_labels"] or 0 for r in rows),
    }


def _row_offsets(per_partition: list[tuple[int, int, int]]) -> tuple[list[int], int]:
    """Global row number of each input partition's first row, numbered from 0 on each side.

    `per_partition` holds (split, partition id, rows); the result is indexed by
    `split * stride + partition id`."""
    stride = max(pid for _, pid, _ in per_partition) + 1
    offsets = [0] * (stride * 2)
    running = {TRAIN: 0, EVAL: 0}
    for split, pid, rows in sorted(per_partition):
        offsets[split * stride + pid] = running[split]
        running[split] += rows
    return offsets, stride


def _partition_keys(num_workers: int) -> list[int]:
    """keys[w]: an int key that `repartition(num_workers, key)` sends to partition w."""
    keys: dict[int, int] = {}
    candidate = 0
    while len(keys) < num_workers:
        keys.setdefault(spark_hash_int(candidate) % num_workers, candidate)
        candidate += 1
    return [keys[w] for w in range(num_workers)]


def spark_hash_int(value: int, seed: int = 42) -> int:
    """Spark's `hash()` of an int column (Murmur3 x86 32-bit, seed 42), as a signed int."""
    mask = 0xFFFFFFFF

    def rotl(x: int, r: int) -> int:
        return ((x << r) | (x >> (32 - r))) & mask

    k1 = (value & mask) * 0xCC9E2D51 & mask
    k1 = rotl(k1, 15) * 0x1B873593 & mask
    h1 = rotl(seed ^ k1, 13)
    h1 = (h1 * 5 + 0xE6546B64) & mask
    h1 ^= 4
    h1 ^= h1 >> 16
    h1 = h1 * 0x85EBCA6B & mask
    h1 ^= h1 >> 13
    h1 = h1 * 0xC2B2AE35 & mask
    h1 ^= h1 >> 16
    return h1 - (1 << 32) if h1 & 0x80000000 else h1
