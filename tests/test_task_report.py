"""The one-row Arrow batches the tasks return (`task.report.record_batch`): the same batch
pyarrow's own conversion builds, and built without importing pandas in a worker."""

import subprocess
import sys
import textwrap

import numpy as np
import pyarrow as pa
import pytest

from sparkdl_avg.task import initial_build, probe
from sparkdl_avg.task.report import FIELDS, record_batch

KINDS = (("i", "int"), ("l", "long"), ("d", "double"), ("s", "string"), ("b", "binary"))


def _by_pyarrow(values: dict, fields) -> pa.RecordBatch:
    """The independent construction: pyarrow converting the Python values itself."""
    arrow = {"int": pa.int32(), "long": pa.int64(), "double": pa.float64(),
             "string": pa.string(), "binary": pa.binary()}
    schema = pa.schema([(name, arrow[kind]) for name, kind in fields])
    return pa.RecordBatch.from_pydict({name: [values[name]] for name, _ in fields},
                                      schema=schema)


@pytest.mark.parametrize("values", [
    {"i": -7, "l": 2**40, "d": 0.1, "s": "héllo ✓", "b": b"\x00\xffab"},
    {"i": np.int32(3), "l": np.int64(-1), "d": np.float32(0.5), "s": "", "b": b""},
    {"i": None, "l": None, "d": None, "s": None, "b": None},
    {"i": 2**31 - 1, "l": -2**63, "d": float("nan"), "s": "x", "b": bytearray(b"xyz")},
    {"i": 0, "l": 5, "d": 3, "s": "y", "b": memoryview(b"0123456789")[2:5]},
])
def test_a_record_batch_equals_pyarrows_own_conversion(values):
    got = record_batch(values, KINDS)
    got.validate(full=True)
    want = _by_pyarrow({k: bytes(v) if isinstance(v, memoryview) else v
                        for k, v in values.items()}, KINDS)
    assert got.schema == want.schema
    assert got.equals(want) or values["d"] != values["d"]  # NaN: compared field by field
    assert got.to_pylist()[0].keys() == want.to_pylist()[0].keys()
    for name, _ in KINDS:
        a, b = got.column(name)[0].as_py(), want.column(name)[0].as_py()
        assert a == b or (a != a and b != b), name


@pytest.mark.parametrize(("field", "value", "error"), [
    ("i", 2**31, OverflowError), ("l", 1.5, TypeError), ("i", "3", TypeError),
    ("s", b"bytes", TypeError), ("d", "x", ValueError), ("l", True, TypeError),
])
def test_a_value_of_the_wrong_type_is_refused_not_converted(field, value, error):
    values = {"i": 1, "l": 1, "d": 1.0, "s": "s", "b": b"b", field: value}
    with pytest.raises(error):
        record_batch(values, KINDS)


def test_every_tasks_row_is_built():
    rows = {"training": (FIELDS, {name: None for name, _ in FIELDS} | {"partition": 1}),
            "probe": (probe.FIELDS, {"partition": 0, "host": "h", "unreachable": None,
                                     "local_dirs": None}),
            "build": (initial_build.FIELDS, {"part": 0, "values": b"\x01" * 10,
                                             "meta": "{}", "error": None})}
    for fields, values in rows.values():
        assert record_batch(values, fields).equals(_by_pyarrow(values, fields))


def test_a_worker_returns_its_rows_without_importing_pandas():
    """What a Python worker forked from the warm daemon has (`import_for_training`, Spark's
    worker module), then each task's row: pandas stays out (its import is 0.35 s of a cold
    worker's probe task)."""
    script = textwrap.dedent("""
        import sys
        from sparkdl_avg.task.probe import FIELDS, import_for_training
        from sparkdl_avg.task.report import record_batch
        assert import_for_training()
        import pyspark.worker  # noqa: F401
        record_batch({"partition": 0, "host": "h", "unreachable": None,
                      "local_dirs": "no room"}, FIELDS)
        print("pandas" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("array", [
    pa.array(np.arange(-5, 5, dtype=np.int8)), pa.array(np.arange(7, dtype=np.uint16)),
    pa.array(np.linspace(-1, 1, 9, dtype=np.float32)), pa.array(np.arange(6.0)),
    pa.array(np.arange(2**40, 2**40 + 9, dtype=np.int64))[3:7],  # a slice: its offset
    pa.array(np.array([0.5, 1.5], np.float16)), pa.array([], pa.int32()),
    pa.array([1, None, 3], pa.int64()), pa.array([1.0, None], pa.float32()),  # nulls
    pa.array([True, False, True]), pa.array([1, 2, 3], pa.uint64()).slice(3),
])
def test_as_numpy_reads_what_to_numpy_reads(array):
    from sparkdl_avg.data.arrow_columns import as_numpy

    got, want = as_numpy(array), array.to_numpy(zero_copy_only=False)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_a_worker_loads_its_partition_without_importing_pandas():
    """A training task's reads of its Arrow batches (`read_column`, `as_numpy`) in a worker
    like the warm daemon's: fixed and ragged numbers, binary and image fields, no pandas."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        import pyarrow as pa
        from sparkdl_avg.data.arrow_columns import as_numpy, read_column
        from sparkdl_avg.data.schema import FieldSpec
        from sparkdl_avg.task.probe import import_for_training
        assert import_for_training()
        with pa.ipc.open_stream(sys.stdin.buffer.read()) as stream:
            batch = stream.read_next_batch()  # as a task gets its rows
        fixed = FieldSpec("input", "x", "x", "_x", "float32", (2,))
        ragged = FieldSpec("input", "t", "t", "_t", "int32", (-1,))
        raw = FieldSpec("input", "b", "b", "_b", "uint8", (-1,), "binary", True)
        assert read_column(batch.column("_x"), fixed).values.shape == (2, 2)
        assert list(read_column(batch.column("_t"), ragged).lengths) == [3, 1]
        assert list(read_column(batch.column("_b"), raw).lengths) == [2, 0]
        assert list(as_numpy(batch.column("_i"))) == [7, 8]
        print("pandas" in sys.modules)
    """)
    batch = pa.RecordBatch.from_pydict({
        "_x": pa.array([[1.0, 2.0], [3.0, 4.0]], pa.list_(pa.float32())),
        "_t": pa.array([[1, 2, 3], [4]], pa.list_(pa.int32())),
        "_b": pa.array([b"ab", b""]), "_i": pa.array([7, 8], pa.int64())})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    done = subprocess.run([sys.executable, "-c", script], input=sink.getvalue().to_pybytes(),
                          capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:].decode()
    assert done.stdout.strip() == b"False"
