"""Spark's `image` source struct packed as the fit carries it (issue 31, without Spark):
`describe.pack_image`'s layout (header ints big-endian, then the pixels) read from Arrow's
struct and from pandas, and split back into the dict a preprocess gets. (The struct through a
fit, scoring and the logged model: tests/test_image_source.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from sparkdl_avg import DataError
from sparkdl_avg.data.raw_rows import raw_batch
from sparkdl_avg.data.schema import DataSchema, FieldSpec


def test_a_packed_header_is_split_into_the_structs_fields():
    field = FieldSpec(role="input", name="image", column="image", wire="_x0", dtype="uint8",
                      shape=(-1,), source="struct<origin:string,...>", encoded=True)
    schema = DataSchema(inputs=(field,), binding="single", labels=(), label_list=False,
                        weight=None, float_dtype="float32")
    rows = [((2, 3, 1, 0), b"abcdef"), ((1, 1, 3, 16), b"xyz")]
    packed = [np.array(ints, ">i4").tobytes() + data for ints, data in rows]
    values = np.frombuffer(b"".join(packed), np.uint8)
    image = raw_batch(schema, [(values, np.array([len(p) for p in packed]))])["image"]
    assert image["data"] == [b"abcdef", b"xyz"]
    assert image["height"].tolist() == [2, 1] and image["nChannels"].tolist() == [1, 3]
    assert image["width"].tolist() == [3, 1] and image["mode"].tolist() == [0, 16]


def test_an_image_struct_is_packed_as_the_fit_carries_it():
    """Arrow's struct (sliced: an offset into every child) and pandas' dicts (int64 ints)
    read as `describe.pack_image` carries them: header ints big-endian, then the pixels."""
    import pyarrow as pa

    from sparkdl_avg.data.arrow_columns import read_column
    from sparkdl_avg.scoring.columns import read_pandas

    field = FieldSpec(role="input", name="image", column="image", wire="_x0", dtype="uint8",
                      shape=(-1,), source="struct<origin:string,...>", encoded=True)
    rows = [{"origin": "a", "height": 9, "width": 9, "nChannels": 9, "mode": 9, "data": b"z"},
            {"origin": "b", "height": 2, "width": 3, "nChannels": 1, "mode": 0, "data": b"abcdef"},
            {"origin": None, "height": 1, "width": 1, "nChannels": 3, "mode": 16, "data": b"xyz"}]
    packed = [np.array([r["height"], r["width"], r["nChannels"], r["mode"]], ">i4").tobytes()
              + r["data"] for r in rows[1:]]
    int32 = pa.struct([("origin", pa.string()), *((n, pa.int32()) for n in
                       ("height", "width", "nChannels", "mode")), ("data", pa.binary())])
    column = read_column(pa.array(rows, int32)[1:], field)
    assert column.values.tobytes() == b"".join(packed)
    assert column.lengths.tolist() == [len(p) for p in packed]
    schema = DataSchema(inputs=(field,), binding="single", labels=(), label_list=False,
                        weight=None, float_dtype="float32")
    import pandas as pd

    for given in (pd.DataFrame({"image": rows[1:]}), {"image": rows[1:]}):
        [again] = read_pandas(given, schema)
        assert again.values.tobytes() == b"".join(packed)
    with pytest.raises(DataError, match="nulls"):
        read_column(pa.array([None, rows[1]], int32), field)
