"""The one validation job: per input partition and side (train or eval), rows, and for every
field its bad values (null; NaN or infinite floats; negative weights), the sizes at each level
of its arrays (a fixed shape, or ragged in its outer length), the range of its integers and
its values in all. Its results make each field's shape (`field_specs`).

Null, NaN and infinite floats in arrays are found with `array_contains`, which Spark compiles
(NaN equals NaN there), not a lambda through `exists`, which it interprets element by element:
the validation over 2M rows of 40 features took 0.87 s this way against 1.86 s, warm medians
(`bench/results/validation_scan-20261125T210301Z.json`). The sizes of nested levels need a
lambda (`transform`); flat arrays, the common case, do not.
"""

from __future__ import annotations

import numpy as np
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl_avg._errors import DataError
from sparkdl_avg.data.columns import EVAL, SPLIT, TRAIN
from sparkdl_avg.data.describe import Source
from sparkdl_avg.data.schema import IGNORE_INDEX, FieldSpec

_SIDES = {TRAIN: "train_df", EVAL: "eval_df"}


def flat(source: Source) -> Column:
    """The field's elements as one flat array (its column for a scalar)."""
    col = F.col(source.wire)
    for _ in range(source.depth - 1):
        col = F.flatten(col)
    return col


def bad_values(source: Source, element: T.DataType) -> Column:
    """True for rows whose field is null or holds a null (also a null inner array), NaN or an
    infinity; or, for the weight, is negative. `array_contains` is null for a null array, or
    for one holding a null and none of the values: both count as bad."""
    col = flat(source)
    if source.depth == 0:
        bad = col.isNull()
        if source.kind == "float":
            bad = bad | F.isnan(col) | (F.abs(col) == float("inf"))
        if source.role == "weight":
            bad = bad | (col < 0)
        return F.coalesce(bad, F.lit(True))
    if source.kind == "float":
        nan, inf = F.lit(float("nan")).cast(element), F.lit(float("inf")).cast(element)
        found = (F.array_contains(col, nan) | F.array_contains(col, inf)
                 | F.array_contains(col, -inf))
        return F.coalesce(found, F.lit(True))
    # isNull first: with ANSI mode off, Spark's size(null) is -1 on both sides
    return F.coalesce(col.isNull() | (F.size(col) != F.size(F.array_compact(col))),
                      F.lit(True))


def bad_features(element: T.DataType) -> Column:
    """`bad_values` of a flat float array column named "features" (kept for its test)."""
    source = Source("input", "features", "features", "features", "float", None, 1, "")
    return bad_values(source, element)


def _level_sizes(source: Source, level: int) -> tuple[Column, Column]:
    """Per row, the least and the most sizes of the arrays at `level` (0: the outer one)."""
    col = F.col(source.wire)
    if level == 0:
        size = F.size(col)
        return size, size
    for _ in range(level - 1):
        col = F.flatten(col)
    sizes = F.transform(col, F.size)
    return F.array_min(sizes), F.array_max(sizes)


def _int_values(source: Source) -> Column:
    """The integers that count for a range: a label's -100 (ignored) does not."""
    col = flat(source)
    if source.role != "label":
        return col
    if source.depth == 0:
        return F.when(col != IGNORE_INDEX, col)
    return F.array_remove(col, IGNORE_INDEX)


def aggregations(sources: list[Source], element: T.DataType,
                 fractional: set[str]) -> list[Column]:
    """The job's aggregate columns; `fractional`: the wires of float labels to count
    non-integer values in (labels of cross_entropy)."""
    out = [F.count(F.lit(1)).alias("rows")]
    for s in sources:
        w = s.wire
        out.append(F.sum(bad_values(s, element).cast(T.LongType())).alias(f"{w}_bad"))
        for level in range(s.depth):
            low, high = _level_sizes(s, level)
            out += [F.min(low).alias(f"{w}_min{level}"), F.max(high).alias(f"{w}_max{level}")]
        if s.depth:
            out.append(F.sum(F.size(flat(s)).cast(T.LongType())).alias(f"{w}_values"))
        if s.kind == "bytes":  # carried as a ragged field of uint8: its lengths in bytes
            size = F.length(F.col(w))
            out += [F.min(size).alias(f"{w}_min0"), F.max(size).alias(f"{w}_max0"),
                    F.sum(size.cast(T.LongType())).alias(f"{w}_values")]
        if s.kind == "int":
            values = _int_values(s)
            low, high = (values, values) if s.depth == 0 else \
                (F.array_min(values), F.array_max(values))
            out += [F.min(low).alias(f"{w}_low"), F.max(high).alias(f"{w}_high")]
        elif s.kind == "float" and s.role == "label":
            v = flat(s)
            low, high = (v, v) if s.depth == 0 else (F.array_min(v), F.array_max(v))
            out += [F.min(low).cast(T.DoubleType()).alias(f"{w}_low"),
                    F.max(high).cast(T.DoubleType()).alias(f"{w}_high")]
        if s.wire in fractional:
            v = flat(s)
            odd = (v != F.floor(v)).cast(T.LongType()) if s.depth == 0 else \
                F.size(F.filter(v, lambda x: x != F.floor(x))).cast(T.LongType())
            out.append(F.sum(odd).alias(f"{w}_fractional"))
        if s.role == "weight":
            out.append(F.sum(F.col(w).cast(T.DoubleType())).alias(f"{w}_sum"))
    return out


def check_rows(rows: list, sources: list[Source], *, has_eval: bool) -> dict[int, int]:
    """Rows per side; DataError for an empty side or any bad value, naming the column."""
    total = {TRAIN: 0, EVAL: 0}
    for r in rows:
        total[r[SPLIT]] += r["rows"]
    if total[TRAIN] == 0:
        raise DataError("train_df is empty")
    if has_eval and total[EVAL] == 0:
        raise DataError("eval_df is empty; pass eval_df=None to skip evaluation")
    for split in (TRAIN, EVAL):
        mine = [r for r in rows if r[SPLIT] == split]
        for s in sources:
            bad = sum(r[f"{s.wire}_bad"] or 0 for r in mine)
            if bad:
                raise DataError(f"{_SIDES[split]} has {bad} rows whose {_what(s)} "
                                f"{_bad_text(s)}; {_fix(s)}")
    return total


def check_widths(rows: list, sources: list[Source]) -> None:
    """DataError for eval_df's integers beyond the width train_df carries a field in: its
    column may be wider (bigint ids where train_df has int), which `describe.carry` leaves
    wide, as Spark's cast would wrap them silently with `spark.sql.ansi.enabled` off. From
    the ranges the job computes anyway: no job of its own."""
    for s in sources:
        if s.kind != "int":
            continue
        mine = [r for r in rows if r[SPLIT] == EVAL and r[f"{s.wire}_low"] is not None]
        if not mine:
            continue
        info = np.iinfo(s.int_dtype)
        low, high = min(r[f"{s.wire}_low"] for r in mine), max(r[f"{s.wire}_high"] for r in mine)
        if low < info.min or high > info.max:
            raise DataError(f"eval_df's {_what(s)} holds {low} to {high}, beyond the "
                            f"{s.int_dtype} train_df carries it in ({info.min} to "
                            f"{info.max}): cast train_df's column to eval_df's wider type, "
                            "or filter those rows out")


def _what(s: Source) -> str:
    column = s.column if isinstance(s.column, str) else list(s.column)
    if s.role == "input":
        return f"features ({column!r})" if s.name in (column, "features") \
            else f"input {s.name!r} ({column!r})"
    return f"{s.role} ({column!r})"


def _bad_text(s: Source) -> str:
    if s.role == "weight":
        return "is null, NaN, infinite or negative"
    if s.depth == 0:
        return "is null, NaN or infinite" if s.kind == "float" else "is null"
    return ("are null or contain null/NaN/infinite values" if s.kind == "float"
            else "are null or contain nulls")


def _fix(s: Source) -> str:
    return "filter or impute them first" if s.role == "input" else "filter them first"


def field_specs(rows: list, sources: list[Source], dtypes: dict[str, str]) -> dict:
    """Each field's FieldSpec (shape from the sizes seen), its integer or label range, and for
    ragged fields their values per row on average and their longest row, from the job's
    `rows`. `dtypes`: each wire's carried
    dtype. DataError for arrays whose shape is not fixed beyond their outer length."""
    specs, ranges, ragged_values, longest = {}, {}, {}, {}
    count = sum(r["rows"] for r in rows)
    for s in sources:
        shape = []
        for level in range(s.depth):
            lows = [r[f"{s.wire}_min{level}"] for r in rows]
            highs = [r[f"{s.wire}_max{level}"] for r in rows]
            lows, highs = [v for v in lows if v is not None], [v for v in highs if v is not None]
            low, high = (min(lows), max(highs)) if lows else (0, 0)
            if low == high and high > 0:
                shape.append(high)
            elif level == 0 and low != high:
                shape.append(-1)
            elif high == 0:
                raise DataError(f"{_what(s)} holds only empty arrays"
                                + (f" at depth {level + 1}" if level else "")
                                + ": no row has a value")
            else:
                raise DataError(
                    f"{_what(s)}: arrays at depth {level + 1} have from {low} to {high} "
                    "values; only the outer length may vary by row (a ragged sequence), "
                    "every inner array needs the same length")
        encoded = s.kind == "bytes"
        if encoded:  # ragged whatever its lengths: a preprocess decodes each row
            shape = [-1]
        spec = FieldSpec(role=s.role, name=s.name, column=s.column, wire=s.wire,
                         dtype=dtypes[s.wire], shape=tuple(shape), source=s.source,
                         encoded=encoded)
        specs[s.wire] = spec
        if spec.ragged:
            ragged_values[s.wire] = sum(r[f"{s.wire}_values"] or 0 for r in rows) / count
            longest[s.wire] = max(r[f"{s.wire}_max0"] or 0 for r in rows)
        if f"{s.wire}_low" in rows[0]:
            lows = [r[f"{s.wire}_low"] for r in rows if r[f"{s.wire}_low"] is not None]
            highs = [r[f"{s.wire}_high"] for r in rows if r[f"{s.wire}_high"] is not None]
            ranges[s.wire] = (min(lows), max(highs)) if lows else None
    return {"specs": specs, "ranges": ranges, "ragged_values": ragged_values,
            "longest": longest}
