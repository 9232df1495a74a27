"""What differs between pyspark lines (`sparkdl_avg/_spark_compat.py`): scoring's pandas UDF
fallback (pyspark 4.0, no `arrow_udf`) must write exactly what the Arrow UDF writes, and what
the model computes locally within rounding (other chunks), for every output shape scoring has;
a pyspark below the floor is refused before any work. CI runs this file on the newest line
and on 4.0 (`-m core`)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from rounding import (
    classes_agree,
    linear_magnitude,
    outputs_tolerance,
    probabilities_tolerance,
    within,
)

from sparkdl_avg import ConfigError, DataError, TrainConfig, _spark_compat
from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.scoring.columns import vector_schema
from sparkdl_avg.scoring.udf import make_predict_udf

pytestmark = [pytest.mark.spark, pytest.mark.core]
MODES = ("prediction", "probability", "raw")


class TwoHeads(torch.nn.Module):
    """A classifier head and a regression head: scoring writes a struct per mode."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(3, 5)

    def forward(self, x):
        h = self.body(x)
        return h[:, :3], h[:, 3:]


def features(rows: int) -> np.ndarray:
    return np.random.default_rng(7).normal(size=(rows, 3)).astype(np.float32)


def score(spark, model, x, kind, monkeypatch, **kwargs) -> list:
    """`model`'s outputs for `x` as Spark writes them, through the UDF `kind` says, in 3
    partitions (a batch of 7 rows each forward call, so a partition spans several)."""
    monkeypatch.setattr(_spark_compat, "scoring_udf_kind", lambda: kind)
    udf = make_predict_udf(model, schema=vector_schema("features", 3, "float32"),
                           batch_size=7, **kwargs)
    df = spark.createDataFrame(pd.DataFrame({"id": range(len(x)), "features": list(x)}))
    rows = df.repartition(3).select("id", udf("features").alias("out")).orderBy("id").collect()
    return [r.out.asDict(recursive=True) if hasattr(r.out, "asDict") else r.out for r in rows]


def kinds() -> list[str]:
    return ["arrow", "pandas"] if _spark_compat.scoring_udf_kind() == "arrow" else ["pandas"]


@pytest.mark.exact
def test_the_pandas_udf_fallback_writes_what_the_arrow_udf_and_the_model_do(spark,
                                                                              monkeypatch):
    x = features(40)
    model = TwoHeads().eval()
    with torch.no_grad():
        logits, values = model(torch.from_numpy(x))
    every = {k: score(spark, model, x, k, monkeypatch, heads=("class", "value"), output=MODES,
                      names=("kind", "size")) for k in kinds()}
    got = every["pandas"]
    # Spark's chunks of 7 against all 40 rows here: within rounding of each other
    apart = outputs_tolerance(torch.float32, 4, linear_magnitude(model.body,
                                                                 torch.from_numpy(x).abs()))
    assert classes_agree([r["prediction"]["kind"] for r in got], logits, apart[:, :3])
    assert within([r["raw"]["kind"] for r in got], logits, apart[:, :3])
    assert within([r["raw"]["size"] for r in got], values, apart[:, 3:])
    softmax = logits.double().softmax(1)
    assert within([r["probability"]["kind"] for r in got], softmax,
                  probabilities_tolerance(softmax, apart[:, :3]))
    assert all(v == got for v in every.values())  # the Arrow UDF's, value for value

    single = torch.nn.Sequential(torch.nn.Linear(3, 4))
    one = {k: score(spark, single, x, k, monkeypatch, heads=("class",)) for k in kinds()}
    with torch.no_grad():
        logits = single(torch.from_numpy(x))
    assert classes_agree(one["pandas"], logits, outputs_tolerance(
        torch.float32, 4, linear_magnitude(single[0], torch.from_numpy(x).abs())))
    assert all(v == one["pandas"] for v in one.values())


def test_the_pandas_udf_fallback_refuses_nan_as_the_arrow_udf_does(spark, monkeypatch):
    x = features(10)
    x[4, 1] = np.nan
    with pytest.raises(Exception, match="NaN or infinite") as caught:
        score(spark, torch.nn.Linear(3, 2), x, "pandas", monkeypatch, heads=("class",))
    assert DataError.__name__ in str(caught.value)


def test_a_null_in_an_integer_input_is_refused_on_every_path(spark, monkeypatch):
    """Spark's pandas conversion (the 4.0 fallback) turns a nullable integer column holding a
    null into float64 NaN: scored as an integer it would become INT64_MIN, a made-up id."""
    ids = FieldSpec(role="input", name="ids", column="ids", wire="_x0", dtype="int64",
                    shape=(), source="bigint")
    schema = DataSchema(inputs=(ids,), binding="single", labels=(), label_list=False,
                        float_dtype="float32")
    torch.manual_seed(0)
    udf = {}
    for kind in kinds():
        monkeypatch.setattr(_spark_compat, "scoring_udf_kind", lambda k=kind: k)
        udf[kind] = make_predict_udf(torch.nn.Embedding(8, 3), schema=schema,
                                     heads=("class",))
    df = spark.createDataFrame([(0, 1), (1, None), (2, 5)], "id long, ids long")
    for kind, f in udf.items():
        with pytest.raises(Exception, match="holds nulls") as caught:
            df.select(f("ids")).collect()
        assert DataError.__name__ in str(caught.value), kind


def test_the_pyfuncs_pandas_and_numpy_input_refuse_a_null_integer_as_well():
    """The MLflow model's input holds a null integer as pandas does: NaN in floats."""
    from sparkdl_avg.scoring.columns import read_pandas

    ids = FieldSpec(role="input", name="ids", column="ids", wire="_x0", dtype="int64",
                    shape=(), source="bigint")
    schema = DataSchema(inputs=(ids,), binding="single", labels=(), label_list=False,
                        float_dtype="float32")
    for data in (pd.DataFrame({"ids": [1, None, 3]}), {"ids": np.array([1.0, np.nan])}):
        with pytest.raises(DataError, match="'ids' .*holds nulls"):
            read_pandas(data, schema)
    assert read_pandas({"ids": np.array([1.0, 2.0])}, schema)[0].values.tolist() == [1, 2]


def test_a_pyspark_below_the_floor_is_refused_before_any_work(spark, monkeypatch):
    import pyspark

    from sparkdl_avg import fit

    monkeypatch.setattr(pyspark, "__version__", "3.5.3")
    with pytest.raises(ConfigError, match=r"pyspark 4\.0 or newer .*toArrow.* 3\.5\.3"):
        fit(spark.range(3), lambda: torch.nn.Linear(3, 2), TrainConfig(num_workers=1))


def test_a_connect_server_older_than_its_client_decides(monkeypatch):
    """On Spark Connect the server's Spark may be an older line than the client's pyspark:
    scoring must not send it an `arrow_udf` it cannot run, nor a fit start on a 3.5 server."""
    from types import SimpleNamespace

    from pyspark.sql import functions

    server = SimpleNamespace(version="4.0.5")
    monkeypatch.setattr(_spark_compat, "_active_session", lambda: server)
    assert _spark_compat.scoring_udf_kind() == "pandas"
    server.version = "4.1.0"
    assert _spark_compat.scoring_udf_kind() == ("arrow" if hasattr(functions, "arrow_udf")
                                                else "pandas")
    _spark_compat.check_pyspark(server)
    with pytest.raises(ConfigError, match=r"4\.0 or newer .*session's Spark is 3\.5\.1"):
        _spark_compat.check_pyspark(SimpleNamespace(version="3.5.1"))


def test_the_session_runs_the_drivers_pyspark(spark):
    """CI's lowest-line run must run that line's Spark (its jars), not only its Python."""
    import pyspark

    assert spark.version == pyspark.__version__


def test_the_executors_run_the_drivers_pyspark(spark):
    """CI's lowest-line run puts its pyspark ahead of the environment's on PYTHONPATH: the
    Python workers must import that one too, or the run would test a mix of two lines."""
    import pyspark

    def version(batches):  # nested: pickled by value
        import pyarrow as pa
        import pyspark

        for _ in batches:
            pass
        yield pa.RecordBatch.from_pydict({"v": [pyspark.__version__]})

    rows = spark.range(2, numPartitions=2).mapInArrow(version, "v string").collect()
    assert {r.v for r in rows} == {pyspark.__version__}
