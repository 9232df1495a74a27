"""Spark's `image` source struct packed as the fit carries it (issue 31): the fit's side,
`describe.pack_image` run by Spark, against `struct.pack('>iiii', ...)` and against the
scoring side's packing (`arrow_columns.read_column` of Arrow's struct, and of pandas' dicts),
for every int32 a header may hold (negative ones too: issue 39); and the packed bytes split
back into the dict a preprocess gets. (The struct through a fit, scoring and the logged model:
tests/test_image_source.py.)"""

from __future__ import annotations

import struct

import numpy as np
import pytest

from sparkdl_avg import DataError
from sparkdl_avg.data.raw_rows import raw_batch
from sparkdl_avg.data.schema import IMAGE_FIELDS, DataSchema, FieldSpec

INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
HEADERS = [(2, 3, 1, 0), (1, 1, 3, 16), (-2, -1, INT32_MIN, INT32_MAX),
           (0, 255, 256, -16), (INT32_MAX, INT32_MIN, -256, -2)]
"""(height, width, nChannels, mode) per row: each field sees a negative value and a value
whose hex has fewer than 8 digits."""
ROWS = [{"origin": f"row {i}", **dict(zip(IMAGE_FIELDS, h, strict=True)),
         "data": bytes(range(i * 3))} for i, h in enumerate(HEADERS)]
FIELD = FieldSpec(role="input", name="image", column="image", wire="_x0", dtype="uint8",
                  shape=(-1,), source="struct<origin:string,...>", encoded=True)
SCHEMA = DataSchema(inputs=(FIELD,), binding="single", labels=(), label_list=False,
                    weight=None, float_dtype="float32")
EXPECTED = [struct.pack(">iiii", *h) + r["data"] for h, r in zip(HEADERS, ROWS, strict=True)]


@pytest.fixture(scope="module")
def packed(spark):
    """`pack_image` of ROWS (and of a row whose `mode` is null) as Spark computes it."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparkdl_avg.data.describe import pack_image

    image = T.StructType([T.StructField("origin", T.StringType()),
                          *(T.StructField(n, T.IntegerType()) for n in IMAGE_FIELDS),
                          T.StructField("data", T.BinaryType())])
    schema = T.StructType([T.StructField("id", T.IntegerType()),
                           T.StructField("image", image)])
    null_mode = {**ROWS[0], "mode": None}
    df = spark.createDataFrame(list(enumerate([*ROWS, null_mode])), schema)
    out = df.select("id", pack_image(F.col("image")).alias("packed")).orderBy("id").collect()
    return [None if r.packed is None else bytes(r.packed) for r in out]


@pytest.mark.spark
def test_pack_image_writes_each_header_int_as_four_big_endian_bytes(packed):
    assert packed[:-1] == EXPECTED
    assert packed[-1] is None  # a null field: null, which validation refuses naming it


@pytest.mark.spark
def test_a_packed_header_is_split_into_the_structs_fields(packed):
    values = np.frombuffer(b"".join(packed[:-1]), np.uint8)
    lengths = np.array([len(p) for p in packed[:-1]])
    image = raw_batch(SCHEMA, [(values, lengths)])["image"]
    assert image["data"] == [r["data"] for r in ROWS]
    for i, name in enumerate(IMAGE_FIELDS):
        assert image[name].dtype == np.int32
        assert image[name].tolist() == [h[i] for h in HEADERS], name


@pytest.mark.spark
def test_scoring_packs_an_image_struct_as_the_fit_does(packed):
    """Arrow's struct (sliced: an offset into every child) and pandas' dicts (int64 ints)
    read as Spark's `pack_image` packed the same rows."""
    import pandas as pd
    import pyarrow as pa

    from sparkdl_avg.data.arrow_columns import read_column
    from sparkdl_avg.scoring.columns import read_pandas

    int32 = pa.struct([("origin", pa.string()), *((n, pa.int32()) for n in IMAGE_FIELDS),
                       ("data", pa.binary())])
    decoy = {"origin": None, **dict.fromkeys(IMAGE_FIELDS, 9), "data": b"z"}
    column = read_column(pa.array([decoy, *ROWS], int32)[1:], FIELD)
    assert column.values.tobytes() == b"".join(packed[:-1])
    assert column.lengths.tolist() == [len(p) for p in packed[:-1]]
    for given in (pd.DataFrame({"image": ROWS}), {"image": ROWS}):
        [again] = read_pandas(given, SCHEMA)
        assert again.values.tobytes() == b"".join(packed[:-1])
    with pytest.raises(DataError, match="nulls"):
        read_column(pa.array([None, ROWS[1]], int32), FIELD)
