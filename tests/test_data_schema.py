"""The one description of the data (`data/schema`), as `prepare` derives it from a DataFrame's
Spark schema and its one validation job: each column's carried dtype and row shape, ragged
fields, what the validation learns (ranges, longest rows), and a typed error naming the
column for everything no model can take."""

from __future__ import annotations

import pytest
from pyspark.sql import types as T

from sparkdl_avg import ConfigError, DataError
from sparkdl_avg.data.prepare import prepare
from sparkdl_avg.data.schema import DataSchema

pytestmark = pytest.mark.spark


def _schema(*fields):
    return T.StructType([T.StructField(n, t) for n, t in fields])


@pytest.fixture(scope="module")
def typed(spark):
    """24 rows of every kind of column."""
    from pyspark.ml.linalg import Vectors, VectorUDT

    rows = [(i % 7, [i % 5, 1, 2][: 1 + i % 3], [[float(i), 1.0], [2.0, 3.0]],
             Vectors.dense([1.0, float(i)]), i % 3, [i % 4, 1][: 1 + i % 2], float(i % 2),
             i % 2 == 0, 1.0 + i % 2, i % 3 - 1)
            for i in range(24)]
    return spark.createDataFrame(rows, _schema(
        ("id", T.ShortType()), ("tokens", T.ArrayType(T.IntegerType())),
        ("image", T.ArrayType(T.ArrayType(T.DoubleType()))), ("vec", VectorUDT()),
        ("label", T.LongType()), ("tags", T.ArrayType(T.IntegerType())),
        ("flabel", T.DoubleType()), ("flag", T.BooleanType()), ("w", T.DoubleType()),
        ("signed", T.IntegerType())))


def _prepare(df, eval_df=None, **kwargs):
    kwargs = {"num_workers": 2, "double_precision": False, **kwargs}
    return prepare(df, eval_df, **kwargs)


def test_every_column_kind_gets_its_dtype_and_row_shape(typed):
    data = _prepare(typed, typed, inputs={"ids": "tokens", "image": "image", "v": "vec",
                                          "flag": "flag", "user": "id"},
                    label_col=["label", "tags", "flabel"], weight_col="w",
                    class_labels=[True, True, True])
    s = data.schema
    got = {f.column: (f.role, f.name, f.dtype, f.shape) for f in s.fields}
    assert got == {
        "tokens": ("input", "ids", "int32", (-1,)),  # ids stay 4 bytes; ragged
        "image": ("input", "image", "float32", (2, 2)),
        "vec": ("input", "v", "float32", (2,)),
        "flag": ("input", "flag", "bool", ()),
        "id": ("input", "user", "int16", ()),
        "label": ("label", "label", "int64", ()),
        "tags": ("label", "tags", "int32", (-1,)),
        "flabel": ("label", "flabel", "int64", ()),  # whole floats to a classifier: classes
        "w": ("weight", "w", "float32", ()),
    }
    assert s.binding == "keyword" and s.label_list and s.float_dtype == "float32"
    assert DataSchema.from_dict(s.to_dict()) == s
    wires = {f.column: f.wire for f in s.fields}
    assert data.ranges[wires["tokens"]] == (0, 4) and data.ranges[wires["id"]] == (0, 6)
    assert data.longest == {wires["tokens"]: 3, wires["tags"]: 2}
    assert data.ragged_values[wires["tokens"]] == pytest.approx(2.0)
    frame = data.frame.schema
    assert isinstance(frame[wires["tokens"]].dataType.elementType, T.IntegerType)
    assert isinstance(frame[wires["image"]].dataType.elementType.elementType, T.FloatType)
    assert data.train_sizes == [12, 12] and data.eval_sizes == [12, 12]


def test_one_vector_as_before_and_assembled_columns(typed):
    data = _prepare(typed, features_col="vec", label_col="flabel", double_precision=True)
    (x,) = data.schema.inputs
    assert (x.name, x.dtype, x.shape, data.schema.binding) == ("vec", "float64", (2,), "single")
    assert data.num_features == 2 and data.schema.labels[0].dtype == "float64"
    data = _prepare(typed, features_col=["id", "w"], label_col="label")
    assert data.schema.inputs[0].shape == (2,) and data.num_features == 2
    data = _prepare(typed, inputs=["tokens", "id"], label_col="label")
    assert data.schema.binding == "positional" and data.num_features is None


def test_an_input_given_as_the_labels_is_carried_and_cached_once(typed):
    """A causal LM's labels are its input_ids: the column is both, travels in one column of
    the prepared frame and is counted once in a row's bytes, each role with its own spec (a
    ragged label pads with -100, its input with 0)."""
    data = _prepare(typed, typed, inputs={"input_ids": "tokens", "user": "id"},
                    label_col="tokens")
    s = data.schema
    (x, _), (y,) = s.inputs, s.labels
    assert (x.role, x.name, y.role, y.name) == ("input", "input_ids", "label", "tokens")
    assert x.wire == y.wire and (x.dtype, x.shape) == (y.dtype, y.shape) == ("int32", (-1,))
    assert (x.pad_value, y.pad_value) == (0, -100)
    assert s.carried == s.inputs and s.slots() == [0, 1, 0]
    assert data.frame.columns == [*(f.wire for f in s.inputs), "_row", "_split"]
    alone = _prepare(typed, inputs={"input_ids": "tokens", "user": "id"}, label_col="label")
    assert s.row_bytes(data.ragged_values) == alone.schema.row_bytes(data.ragged_values) - 8
    assert DataSchema.from_dict(s.to_dict()) == s


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"features_col": "image", "inputs": ["tokens"]}, ConfigError, "either inputs= or"),
    ({"inputs": {"not a name": "tokens"}}, ConfigError, "'not a name' is not a parameter"),
    ({"inputs": []}, ConfigError, "inputs is empty"),
    ({"inputs": "tokens"}, ConfigError, "inputs must be a list"),
    ({"inputs": ["tokens", "tokens"]}, ConfigError, r"\['tokens'\] are bound more than once"),
    ({"inputs": ["tokens"], "label_col": ["label", "label"]}, ConfigError,
     r"\['label'\] are bound more than once.*not two inputs, two labels"),
    ({"inputs": ["tokens"], "label_col": ["tokens", "tokens"]}, ConfigError,
     r"\['tokens'\] are bound more than once"),  # an input's column, as two labels
    ({"inputs": ["tokens", "w"], "weight_col": "w"}, ConfigError,
     r"\['w'\] are bound more than once.*withColumn\('w_copy', F.col\('w'\)\)"),
    ({"inputs": ["tokens"], "label_col": "label", "weight_col": "label"}, ConfigError,
     r"\['label'\] are bound more than once"),
    ({"features_col": "flabel", "label_col": "flabel", "class_labels": [True]}, ConfigError,
     r"column 'flabel' is input 'flabel' \(floats\) and the label of cross_entropy"),
    ({"inputs": ["tokens"], "label_col": []}, ConfigError, "label_col must be"),
    ({"inputs": ["tokens"], "weight_col": "tags"}, DataError,
     "weight column 'tags' has type array<int>"),
    ({"inputs": ["tokens"], "weight_col": "signed"}, DataError,
     "8 rows whose weight .'signed'. is null, NaN, infinite or negative"),
    ({"inputs": ["tokns"]}, DataError, "no column 'tokns'.*did you mean 'tokens'"),
])
def test_arguments_that_do_not_fit_are_refused(typed, kwargs, error, message):
    with pytest.raises(error, match=message):
        _prepare(typed, **kwargs)


@pytest.mark.parametrize(("spark_type", "value", "message"), [
    (T.StringType(), "a", "column 'x' has type string.*token ids as array<int>"),
    (T.BinaryType(), b"a", r"column 'x' has type binary.*needs fit\(preprocess=fn\)"),
    (T.MapType(T.StringType(), T.IntegerType()), {"a": 1}, "has type map<string,int>"),
    (T.ArrayType(T.StringType()), ["a"], r"has type array<string>.*reach neither a model nor "
                                         r"fit\(preprocess=\).*concat_ws"),
    (T.StructType([T.StructField("a", T.IntegerType())]), (1,), "struct's fields"),
])
def test_types_no_model_takes_are_named_with_what_to_do(spark, spark_type, value, message):
    df = spark.createDataFrame([(value, 1)] * 4, _schema(("x", spark_type),
                                                         ("label", T.IntegerType())))
    with pytest.raises(DataError, match=message):
        _prepare(df, inputs=["x"])
    with pytest.raises(DataError, match="label column 'x' has type"):
        _prepare(df.withColumnRenamed("label", "y"), features_col="y", label_col="x")


@pytest.mark.parametrize(("rows", "message"), [
    ([[[1, 2], [3]]], r"depth 2 have from 1 to 2 values; only the outer length may vary"),
    ([[[1, None]]], "1 rows whose features .'x'. are null or contain nulls"),
    ([None], "are null or contain nulls"),
])
def test_shapes_and_nulls_of_nested_int_arrays(spark, rows, message):
    dtype = T.ArrayType(T.ArrayType(T.IntegerType()))
    good = [[[1, 2], [3, 4]]] * 3
    df = spark.createDataFrame([(r, 0) for r in good + rows],
                               _schema(("x", dtype), ("label", T.IntegerType())))
    with pytest.raises(DataError, match=message):
        _prepare(df, features_col="x", num_workers=1)


def test_empty_arrays_are_refused_and_an_empty_ragged_row_is_not(spark):
    dtype = T.ArrayType(T.ArrayType(T.IntegerType()))
    df = spark.createDataFrame([([[], []], 0)] * 3,
                               _schema(("x", dtype), ("label", T.IntegerType())))
    with pytest.raises(DataError, match="features .'x'. holds only empty arrays at depth 2"):
        _prepare(df, features_col="x", num_workers=1)
    df = spark.createDataFrame([([[1, 2]], 0), ([], 0)], _schema(("x", dtype),
                                                              ("label", T.IntegerType())))
    assert _prepare(df, features_col="x", num_workers=1).schema.inputs[0].shape == (-1, 2)


def test_nan_in_a_nested_float_label_and_an_all_zero_weight(spark):
    nan = float("nan")
    df = spark.createDataFrame(
        [([1.0], [[0.5, 1.0]], 0.0)] * 3 + [([1.0], [[nan, 1.0]], 0.0)],
        _schema(("x", T.ArrayType(T.DoubleType())),
                ("y", T.ArrayType(T.ArrayType(T.DoubleType()))), ("w", T.DoubleType())))
    with pytest.raises(DataError, match=r"1 rows whose label \('y'\) are null or contain "
                                        "null/NaN/infinite"):
        _prepare(df, features_col="x", label_col="y", num_workers=1)
    with pytest.raises(DataError, match="every weight in column 'w' is 0"):
        _prepare(df.limit(3), features_col="x", label_col="y", weight_col="w",
                 num_workers=1)


def test_eval_df_of_another_kind_is_refused(spark, typed):
    other = typed.withColumn("tokens", typed["id"])
    with pytest.raises(DataError, match="column 'tokens' is smallint in eval_df but "
                                        "array<int> in train_df"):
        _prepare(typed, other, inputs=["tokens"])


def test_an_eval_df_without_the_weight_column_weighs_its_rows_1(typed):
    data = _prepare(typed, typed.drop("w"), features_col="vec", label_col="label",
                    weight_col="w")
    weights = data.frame.filter("_split = 1").select(data.schema.weight.wire).distinct()
    assert [r[0] for r in weights.collect()] == [1.0]


def test_chunks_are_sized_by_rows_padded_to_the_longest():
    """A ragged field's mean sizes its cache; its longest row sizes a chunk to evaluate or
    score (rows pad to their longest), so a long tail cannot take a chunk past its budget."""
    from sparkdl_avg.data.schema import FieldSpec

    tokens = FieldSpec("input", "t", "t", "_x0", "int32", (-1, 2))
    label = FieldSpec("label", "y", "y", "_y0", "int64", ())
    s = DataSchema((tokens,), "single", (label,), False)
    assert s.row_bytes({"_x0": 4.0}) == 16 + 4 * 4 + 8  # start and length, values, label
    assert s.padded_row_bytes({"_x0": 100}) == 16 + 100 * 2 * 4 + 8
