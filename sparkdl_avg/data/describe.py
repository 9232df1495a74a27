"""What the fit's arguments name, read from the DataFrame's schema (Spark side, before any job):
which columns are inputs, labels and the weight, how the inputs reach the model, and for each
column the expression that carries it in its carried type. Shapes come later, from the
validation job (`data/validate`); together they make the `schema.DataSchema`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql import types as T

from sparkdl_avg._errors import ConfigError, DataError
from sparkdl_avg.data.schema import IMAGE_FIELDS

DEFAULT_FEATURES = "features"
_INTS = {T.ByteType: "int8", T.ShortType: "int16", T.IntegerType: "int32",
         T.LongType: "int64"}
_FLOATS = (T.FloatType, T.DoubleType, T.DecimalType)
_REFUSED = {
    T.StringType: "a string column (text to tokenize) needs fit(preprocess=fn), which gets "
                  "it as a list of str, or turn it into numbers on the Spark side first "
                  "(token ids as array<int>, a category as an int id)",
    T.BinaryType: "a binary column (image files, encoded records) needs fit(preprocess=fn) "
                  "to decode it, or decode it into arrays on the Spark side",
    T.MapType: "turn a map into arrays or separate columns",
    T.StructType: "select the struct's fields as columns of their own (Spark's image "
                  "source struct is read with fit(preprocess=fn))",
}


@dataclass(frozen=True, slots=True)
class Source:
    """One field before validation: where it comes from and how it is carried."""

    role: str
    name: str
    column: str | tuple[str, ...]
    wire: str
    kind: str
    """"int", "bool" or "float" (the elements), or "bytes" (a binary column, encoded)."""
    int_dtype: str | None
    """An integer field's carried width ("int32"...), from its Spark type."""
    depth: int
    """Levels of arrays around the elements (a vector or assembled columns: 1)."""
    source: str
    vector: bool = False


@dataclass(frozen=True, slots=True)
class Binding:
    sources: tuple[Source, ...]
    binding: str
    label_list: bool


def bind(df: DataFrame, *, features_col, inputs, label_col, weight_col,
         encoded: bool = False) -> Binding:
    """The fields `fit`'s arguments name in `df` (train_df). ConfigError for arguments that
    do not fit together, DataError for a column that is missing or of a type no model takes.
    `encoded`: the fit has a preprocess, so binary inputs and labels are carried as bytes."""
    if not isinstance(df, DataFrame):
        raise DataError(f"train_df must be a pyspark DataFrame, got {type(df).__name__}")
    sources: list[Source] = []
    if inputs is None:
        binding = "single"
        name = features_col if isinstance(features_col, str) else DEFAULT_FEATURES
        sources.append(_source(df, "input", name, features_col, "_x0", "features_col",
                               encoded))
    else:
        if features_col != DEFAULT_FEATURES:
            raise ConfigError("pass either inputs= or features_col=, not both: inputs names "
                              "every column the model takes")
        if isinstance(inputs, Mapping):
            binding, pairs = "keyword", list(inputs.items())
            for key, _ in pairs:
                if not isinstance(key, str) or not key.isidentifier():
                    raise ConfigError(f"inputs' keys are the model's forward parameters; "
                                      f"{key!r} is not a parameter name")
        elif isinstance(inputs, Sequence) and not isinstance(inputs, str):
            binding, pairs = "positional", [(c, c) for c in inputs]
        else:
            raise ConfigError(f"inputs must be a list of columns (model(*tensors)) or a dict "
                              f"{{forward parameter: column}} (model(**tensors)); got "
                              f"{inputs!r}")
        if not pairs:
            raise ConfigError("inputs is empty: name at least one column")
        for i, (key, column) in enumerate(pairs):
            if not isinstance(column, str):
                raise ConfigError(f"inputs: {column!r} is not a column name")
            sources.append(_source(df, "input", key, column, f"_x{i}", "inputs", encoded))
    label_list = not isinstance(label_col, str)
    labels = [label_col] if not label_list else label_col
    if label_list and (not isinstance(labels, Sequence) or not labels
                       or not all(isinstance(c, str) for c in labels)):
        raise ConfigError(f"label_col must be a column name or a non-empty list of them, "
                          f"got {label_col!r}")
    for i, column in enumerate(labels):
        sources.append(_source(df, "label", column, column, f"_y{i}", "label_col", encoded))
    if weight_col is not None:
        if not isinstance(weight_col, str):
            raise ConfigError(f"weight_col must be a column name, got {weight_col!r}")
        weight = _source(df, "weight", weight_col, weight_col, "_w", "weight_col", encoded)
        if weight.depth or weight.kind == "bool":
            raise DataError(f"weight column {weight_col!r} has type {weight.source}; a weight "
                            "is one number >= 0 per row")
        sources.append(weight)
    sources = _share_inputs(sources)
    if encoded:
        sources.extend(_ident(df, {s.column for s in sources}))
    return Binding(tuple(sources), binding, label_list)


def _share_inputs(sources: list[Source]) -> list[Source]:
    """A label bound to an input's column (a causal LM's labels are its input_ids) takes the
    input's wire: the column is carried and cached once, and a batch hands both roles the
    same rows. Any other column bound twice is refused: two inputs or two labels from one
    column are likelier a slip in the arguments than a model's wish, and the weight is
    carried in a form of its own (a float >= 0, 1 in an eval_df without it)."""
    inputs = {s.column: s.wire for s in sources if s.role == "input"
              and isinstance(s.column, str)}
    shared = [replace(s, wire=inputs[s.column]) if s.role == "label" and s.column in inputs
              else s for s in sources]
    alone = [s.column for s in shared if isinstance(s.column, str)
             and not (s.role == "label" and s.column in inputs)]
    labels = [s.column for s in shared if s.role == "label"]
    twice = sorted({c for c in alone if alone.count(c) > 1}
                   | {c for c in labels if labels.count(c) > 1})
    if twice:
        raise ConfigError(
            f"column(s) {twice} are bound more than once among inputs, labels and the "
            "weight. A column may be an input and a label at once (carried once), but not "
            "two inputs, two labels, or the weight and anything else: copy it if you mean "
            f"it: train_df.withColumn('{twice[0]}_copy', F.col('{twice[0]}'))")
    return shared


IDENT_COLUMNS = ("path", "id", "uri", "key", "file")
"""Columns that name a row (binaryFile's `path`): with a preprocess the first one present
and not otherwise bound is carried, so an error names the record it failed on."""


def _ident(df: DataFrame, bound: set) -> list[Source]:
    types = {f.name: f.dataType for f in df.schema.fields}
    for name in IDENT_COLUMNS:
        if name not in bound and isinstance(types.get(name), (T.StringType, T.BinaryType,
                                                                T.IntegralType)):
            return [Source("ident", name, name, "_id0", "bytes", None, 0,
                           types[name].simpleString())]
    return []


def _source(df: DataFrame, role: str, name: str, column, wire: str, argument: str,
            encoded: bool = False) -> Source:
    if isinstance(column, str):
        field = find_column(df, column, argument, "train_df")
        kind, int_dtype, depth, vector = classify_type(field.dataType, column, "train_df",
                                                       role, encoded=encoded)
        return Source(role, name, column, wire, kind, int_dtype, depth,
                      field.dataType.simpleString(), vector)
    if role != "input" or not isinstance(column, Sequence) or not column:
        raise ConfigError(f"{argument} must be a column name or a non-empty list, got "
                          f"{column!r}")
    check_numeric(df, column, argument, "train_df")  # assembled into one vector
    return Source(role, name, tuple(column), wire, "float", None, 1,
                  f"{len(column)} numeric columns")


def check_numeric(df: DataFrame, columns, argument: str, frame_name: str) -> None:
    """DataError naming the first of `columns` (numeric scalars to assemble into one vector)
    that is missing or not numeric."""
    for part in columns:
        field = find_column(df, part, argument, frame_name)
        if not isinstance(field.dataType, (*_FLOATS, *_INTS)):
            hint = "cast it to a number"
            if isinstance(field.dataType, T.StringType):
                hint = ("turn it into numbers on the Spark side first (a category as an int "
                        "id), or pass text as an input of its own (inputs=) with "
                        "fit(preprocess=fn), which gets it as a list of str")
            elif isinstance(field.dataType, T.ArrayType):
                hint = "an array is an input of its own: name it in inputs="
            raise DataError(f"{frame_name} feature column {part!r} has type "
                            f"{field.dataType.simpleString()}, but the columns of "
                            f"{argument} are assembled into one vector of numbers: {hint}, "
                            "or leave it out of the list")


def find_column(df: DataFrame, name: object, argument: str, frame_name: str) -> T.StructField:
    if not isinstance(name, str):
        raise DataError(f"{argument} must be a column name, got {name!r}")
    fields = {f.name: f for f in df.schema.fields}
    if name not in fields:
        hint = difflib.get_close_matches(name, list(fields), n=1)
        did_you_mean = f"; did you mean {hint[0]!r}?" if hint else ""
        raise DataError(f"{frame_name} has no column {name!r} ({argument}){did_you_mean} "
                        f"Columns: {sorted(fields)}")
    return fields[name]


def classify_type(dtype: T.DataType, column: str, frame_name: str, role: str = "input", *,
                  encoded: bool = False):
    """(kind, int width, array depth, is a vector) of a column's Spark type; DataError for a
    type no model takes, saying what to do. `encoded`: a binary or string input or label is
    "bytes" (a preprocess decodes it: a string as its UTF-8 bytes); nothing is decoded by
    guess."""
    if type(dtype).__name__ == "VectorUDT":
        return "float", None, 1, True
    if encoded and (isinstance(dtype, (T.BinaryType, T.StringType)) or
                    is_image_struct(dtype)):
        if role == "weight":
            raise DataError(f"{frame_name} weight column {column!r} is "
                            f"{dtype.simpleString()}; a weight is one number >= 0 per row")
        return "bytes", None, 0, False
    depth, whole = 0, dtype
    while isinstance(dtype, T.ArrayType):
        dtype, depth = dtype.elementType, depth + 1
    if isinstance(dtype, T.BooleanType):
        return "bool", None, depth, False
    if type(dtype) in _INTS:
        return "int", _INTS[type(dtype)], depth, False
    if isinstance(dtype, _FLOATS):
        return "float", None, depth, False
    hint = next((h for t, h in _REFUSED.items() if isinstance(dtype, t)),
                "use numbers, booleans, arrays of them or a pyspark.ml vector")
    if depth and isinstance(dtype, (T.StringType, T.BinaryType)):
        hint = (f"arrays of {dtype.simpleString()} reach neither a model nor fit(preprocess=) "
                f"(which takes a whole {dtype.simpleString()} column a row); turn them into "
                "numbers on the Spark side (token ids as array<int>), or into one value a row "
                "(concat_ws for strings) for the preprocess to split")
    what = {"input": "", "label": "label ", "weight": "weight "}[role]
    raise DataError(f"{frame_name} {what}column {column!r} has type {whole.simpleString()}, "
                    f"which no model takes: {hint}")


def is_image_struct(dtype: T.DataType) -> bool:
    """Spark's `image` source struct: `data` binary, its size and mode as ints."""
    if not isinstance(dtype, T.StructType):
        return False
    types = {f.name: f.dataType for f in dtype.fields}
    return isinstance(types.get("data"), T.BinaryType) and all(
        isinstance(types.get(n), T.IntegerType) for n in IMAGE_FIELDS)


def pack_image(col: Column) -> Column:
    """An image struct as one binary value (the header, then `data`), so it is validated,
    carried and cached like any binary column; `raw_rows.raw_batch` splits it again. A null
    image, or a null field, gives null (refused by validation, naming the column). Each int
    is its 4 bytes of two's complement, big-endian, as `arrow_columns._image_column` packs
    them: Spark's `hex` of a negative int writes the 16 digits of its long, so the int is
    taken as its low 32 bits first, a long of at most 8 hex digits."""
    low = F.lit(0xFFFFFFFF)  # a long literal: the AND widens the int to long first
    header = [F.unhex(F.lpad(F.hex(col[n].cast(T.LongType()).bitwiseAND(low)), 8, "0"))
              for n in IMAGE_FIELDS]
    return F.concat(*header, col["data"])


def carried_type(source: Source, float_type: T.DataType) -> T.DataType:
    """The Spark type a field travels in: its integer width, boolean, or the model's float."""
    element = {"bool": T.BooleanType(), "float": float_type,
               "bytes": T.BinaryType()}.get(source.kind) or \
        {v: k for k, v in _INTS.items()}[source.int_dtype]()
    for _ in range(source.depth):
        element = T.ArrayType(element)
    return element


def carry(df: DataFrame, source: Source, float_type: T.DataType, frame_name: str) -> Column:
    """`source`'s column of `df` (train_df, eval_df or a DataFrame to score) in its carried
    type, as `source.wire`. DataError when its column is of another kind than train_df's.
    Integers wider than train_df's stay as wide: Spark's cast would narrow them by wrapping,
    silently with `spark.sql.ansi.enabled` off (an id 2**32 + 3 becoming 3), so the
    narrowing is left to whoever reads them with a range check: the validation job
    (`validate.check_widths`), or scoring's reader (`arrow_columns.check_fits`)."""
    if isinstance(source.column, tuple):
        check_numeric(df, source.column, "features_col", frame_name)
        parts = [F.col(f"`{part}`").cast(float_type) for part in source.column]
        return F.array(*parts).alias(source.wire)
    if source.role == "ident":  # utf-8 bytes (an integer as its digits); none in an eval_df
        col = F.col(f"`{source.column}`")  # without it
        if source.source not in ("string", "binary"):
            col = col.cast(T.StringType())
        col = col.cast(T.BinaryType()) if source.column in df.columns \
            else F.lit(None).cast(T.BinaryType())
        return F.coalesce(col, F.lit("").cast(T.BinaryType())).alias(source.wire)
    field = find_column(df, source.column, source.role, frame_name)
    kind, width, depth, vector = classify_type(field.dataType, source.column, frame_name,
                                               source.role, encoded=source.kind == "bytes")
    text = isinstance(field.dataType, T.StringType)  # a preprocess gets str, not bytes
    if (kind, depth) != (source.kind, source.depth) and not \
            (kind == "int" and source.kind == "float" and depth == source.depth) or \
            (kind == "bytes" and text != (source.source == "string")):
        raise DataError(f"column {source.column!r} is {field.dataType.simpleString()} in "
                        f"{frame_name} but {source.source} in train_df; cast both alike")
    col = F.col(f"`{source.column}`")
    if vector:
        from pyspark.ml.functions import vector_to_array

        name = "float64" if isinstance(float_type, T.DoubleType) else "float32"
        return vector_to_array(col, dtype=name).alias(source.wire)
    if kind == "bytes" and is_image_struct(field.dataType):
        return pack_image(col).alias(source.wire)
    if kind == "int" == source.kind and _wider(width, source.int_dtype):
        return col.alias(source.wire)
    return col.cast(carried_type(source, float_type)).alias(source.wire)


def _wider(int_dtype: str, than: str | None) -> bool:
    widths = list(_INTS.values())  # narrowest first
    return than in widths and widths.index(int_dtype) > widths.index(than)


def input_columns(df: DataFrame, schema, frame_name: str = "df") -> list[Column]:
    """The schema's inputs read from `df` (a DataFrame to score) as the fit carried them, each
    named by its wire. DataError for a column that is missing or of another kind than the
    fit's."""
    float_type = T.DoubleType() if schema.float_dtype == "float64" else T.FloatType()
    return [carry(df, Source(f.role, f.name, f.column, f.wire, f.kind,
                             f.dtype if f.kind == "int" else None,
                             0 if f.encoded else len(f.shape), f.source),
                  float_type, frame_name) for f in schema.inputs]


def ident_columns(df: DataFrame, schema) -> list[Column]:
    """The schema's identifying columns (`DataSchema.idents`: `path`...) read from `df` as
    the fit carried them (UTF-8 bytes), each named by its wire."""
    return [carry(df, Source(f.role, f.name, f.column, f.wire, "bytes", None, 0, f.source),
                  T.FloatType(), "df") for f in schema.idents]
