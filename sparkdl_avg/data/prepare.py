"""From the user's DataFrame to `num_workers` balanced, validated partitions (Spark side).

The fit's arguments name the columns (`describe.bind`); each is carried in its own type (ints
at their width, floats as the model's, arrays nested, vectors as arrays). One aggregation job
(`validate`) checks every field and counts rows per input partition, and its results make the
`schema.DataSchema` every later stage reads; the counts number the rows globally, and a hash
key chosen per worker sends row g to partition `g % num_workers` in a single shuffle.
Training then reads each partition once through `mapInArrow`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pyspark.sql import DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl_avg._errors import ConfigError, DataError
from sparkdl_avg.data import validate
from sparkdl_avg.data.columns import EVAL, INDEX, SPLIT, TRAIN
from sparkdl_avg.data.describe import DEFAULT_FEATURES, Source, bind, carried_type, carry
from sparkdl_avg.data.order import partition_sizes
from sparkdl_avg.data.schema import DataSchema


@dataclass(frozen=True, slots=True)
class PreparedData:
    """Validated data, partitioned one partition per worker, and what was learned about it."""

    frame: DataFrame
    schema: DataSchema
    train_sizes: list[int]
    eval_sizes: list[int]
    ranges: dict[str, tuple[float, float] | None] = field(default_factory=dict)
    """Per wire of an integer field or a label: its least and largest value (a label's -100
    not counted); None when it has none."""
    ragged_values: dict[str, float] = field(default_factory=dict)
    """Per ragged wire: values per row, on average."""
    longest: dict[str, int] = field(default_factory=dict)
    """Per ragged wire: the longest row's outer length."""
    sample: DataFrame | None = None
    """train_df's fields as carried, before the shuffle: a few rows of it are cheap to read
    (`fit(preprocess=)` learns the model's fields from them)."""

    @property
    def num_features(self) -> int | None:
        """The width of a single vector input (what a fit of one vector reports)."""
        return self.schema.num_features


def prepare(
    train_df: DataFrame,
    eval_df: DataFrame | None,
    *,
    features_col: str | Sequence[str] = DEFAULT_FEATURES,
    inputs=None,
    label_col: str | Sequence[str] = "label",
    weight_col: str | None = None,
    num_workers: int,
    double_precision: bool,
    class_labels: Sequence[bool] = (),
    encoded: bool = False,
) -> PreparedData:
    """`class_labels[k]`: label k feeds a classifier's cross-entropy, so a float column of
    whole numbers is carried as int64 class indices (a fractional one is a DataError).
    `encoded`: the fit has a preprocess, so binary inputs and labels are carried as bytes."""
    element = T.DoubleType() if double_precision else T.FloatType()
    binding = bind(train_df, features_col=features_col, inputs=inputs, label_col=label_col,
                   weight_col=weight_col, encoded=encoded)
    sources = list(binding.sources)
    labels = [s for s in sources if s.role == "label"]
    to_classes = {s.wire for s, c in zip(labels, class_labels, strict=False)
                  if c and s.kind == "float"}
    _check_shared(sources, to_classes)
    every, sources = sources, _one_per_wire(sources)  # a column bound twice travels once
    carried_train = _carried(train_df, "train_df", sources, element)
    frames = [carried_train]
    if eval_df is not None:
        if not isinstance(eval_df, DataFrame):
            raise DataError(f"eval_df must be a pyspark DataFrame, got {type(eval_df).__name__}")
        frames.append(_carried(eval_df, "eval_df", sources, element))
    # Rows are numbered on each side before the union, so both sides count from 0 however
    # Spark lays out the union's partitions.
    wires = [s.wire for s in sources]
    frames = [frame.select(*wires, F.lit(split).cast(T.ByteType()).alias(SPLIT),
                           F.spark_partition_id().alias("_pid"),
                           F.monotonically_increasing_id().alias("_mid"))
              for split, frame in enumerate(frames)]
    numbered = frames[0] if len(frames) == 1 else frames[0].unionByName(frames[1])
    rows = numbered.groupBy(SPLIT, "_pid").agg(
        *validate.aggregations(sources, element, to_classes)).collect()
    totals = validate.check_rows(rows, sources, has_eval=eval_df is not None)
    validate.check_widths(rows, sources)
    for s in labels:
        odd = sum(r[f"{s.wire}_fractional"] or 0 for r in rows) if s.wire in to_classes else 0
        if odd:
            raise DataError(f"label column {s.column!r} has {odd} non-integer values; "
                            "cross_entropy needs integer class labels")
    sources = [_as_classes(s) if s.wire in to_classes else s for s in sources]
    dtypes = {s.wire: _dtype(s, element) for s in sources}
    learned = validate.field_specs(rows, sources, dtypes)

    def spec(s: Source):  # a label on an input's column: the input's spec, in its own role
        got = learned["specs"][s.wire]
        return got if got.role == s.role else replace(got, role=s.role, name=s.name)

    schema = DataSchema(
        inputs=tuple(spec(s) for s in every if s.role == "input"),
        binding=binding.binding, label_list=binding.label_list,
        labels=tuple(spec(s) for s in every if s.role == "label"),
        weight=next((spec(s) for s in every if s.role == "weight"), None),
        float_dtype="float64" if double_precision else "float32",
        idents=tuple(spec(s) for s in every if s.role == "ident"))
    if schema.weight is not None and not any(r[f"{schema.weight.wire}_sum"] for r in rows
                                             if r[SPLIT] == TRAIN):
        raise DataError(f"every weight in column {weight_col!r} is 0: nothing would train")

    offsets, stride = _row_offsets([(r[SPLIT], r["_pid"], r["rows"]) for r in rows])
    local_pos = F.col("_mid") - F.shiftleft(F.col("_pid").cast(T.LongType()), 33)
    slot = F.col(SPLIT).cast(T.IntegerType()) * stride + F.col("_pid") + 1
    row = F.element_at(F.array(*[F.lit(o) for o in offsets]), slot) + local_pos
    keys = _partition_keys(num_workers)
    key = F.element_at(F.array(*[F.lit(k) for k in keys]),
                       (row % num_workers).cast(T.IntegerType()) + 1)
    # eval_df's wider integers (the union's type: `describe.carry`) narrowed, now that
    # validation saw them fit
    carried = [F.col(s.wire).cast(carried_type(s, element)).alias(s.wire)
               if s.wire in to_classes or s.kind == "int" else F.col(s.wire) for s in sources]
    frame = (
        numbered.withColumn(INDEX, row)
        .withColumn("_key", key)
        .repartition(num_workers, "_key")
        .select(*carried, F.col(INDEX), F.col(SPLIT))
    )
    return PreparedData(
        frame=frame, schema=schema, sample=carried_train.select(*carried),
        train_sizes=partition_sizes(totals[TRAIN], num_workers),
        eval_sizes=partition_sizes(totals[EVAL], num_workers),
        ranges=learned["ranges"], ragged_values=learned["ragged_values"],
        longest=learned["longest"])


def _carried(df: DataFrame, frame_name: str, sources: list[Source],
             element: T.DataType) -> DataFrame:
    """`df`'s fields in their carried types; an eval_df without the weight column weighs
    each of its rows 1."""
    return df.select(*[
        F.lit(1).cast(carried_type(s, element)).alias(s.wire)
        if s.role == "weight" and frame_name == "eval_df" and s.column not in df.columns
        else carry(df, s, element, frame_name) for s in sources])


def _as_classes(source: Source) -> Source:
    return replace(source, kind="int", int_dtype="int64")


def _one_per_wire(sources: list[Source]) -> list[Source]:
    """The sources as carried: the first of each wire (an input before the label that
    shares its column)."""
    first: dict[str, Source] = {}
    for s in sources:
        first.setdefault(s.wire, s)
    return list(first.values())


def _check_shared(sources: list[Source], to_classes: set[str]) -> None:
    """A column bound as an input and a label is carried once, as the input is: a label that
    needs another form (a float column as cross_entropy's int64 classes) cannot share it."""
    inputs = {s.wire: s for s in sources if s.role == "input"}
    for s in sources:
        if s.role == "label" and s.wire in inputs and s.wire in to_classes:
            raise ConfigError(
                f"column {s.column!r} is input {inputs[s.wire].name!r} (floats) and the "
                "label of cross_entropy, which needs integer classes: one column is carried "
                "once, in one form. Give the label its own column: train_df.withColumn("
                f"'label', F.col('{s.column}').cast('int')) and label_col='label'")


def _dtype(source: Source, element: T.DataType) -> str:
    if source.kind == "int":
        return source.int_dtype
    if source.kind == "bool":
        return "bool"
    if source.kind == "bytes":
        return "uint8"
    return "float64" if isinstance(element, T.DoubleType) else "float32"


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
