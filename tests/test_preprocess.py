"""Records that need decoding (issue 31, slice 1 and part of 2): a binary column carried as
bytes into the cache and through `fit(preprocess=fn)` off the training thread. A decode-only
preprocess trains bit-identically to the same numbers given as an array column (memory and
disk caches; evaluation too; async lockstep to 1e-10); random augmentation through `rng` is
bit-identical across two fits and across a restart after a failure mid-fit; a 25 ms
preprocess beside a 25 ms step overlaps it; a preprocess that raises fails the fit once, and
a corrupt record fails it once naming its `path`; `transform`, the logged MLflow model
(pyfunc predict on bytes, `spark_udf` on binary rows) and the Spark ML model (saved and
loaded) preprocess the raw columns with training=False."""

from __future__ import annotations

import os
import re
import time
from functools import partial

import numpy as np
import pyarrow as pa
import pytest
import torch
from faulty import same_parameters
from rounding import sum_tolerance

from sparkdl_avg import DataError, ModelError, PreprocessError, TrainConfig, fit
from sparkdl_avg.data.arrow_columns import read_column
from sparkdl_avg.data.feed import Preprocessor, model_schema, step_rng
from sparkdl_avg.data.raw_rows import raw_batch
from sparkdl_avg.data.schema import DataSchema, FieldSpec

WIDTH, CLASSES, ROWS = 4, 3, 96
COMMON = dict(num_workers=2, epochs=2, batch_size=8, optimizer="sgd", lr=0.1, shuffle=True,
              seed=5, log_model=False, experiment_name="preprocess")
SYNC = dict(COMMON, averaging_frequency=2)


def _decode(batch, *, training, rng):
    """float64 vectors stored as raw little-endian bytes, one record a row."""
    x = np.frombuffer(b"".join(batch["content"]), np.float64).reshape(-1, WIDTH)
    return {"content": x}


def _augment(batch, *, training, rng):  # evaluation sees the records as they are
    out = _decode(batch, training=training, rng=rng)
    if training:  # noise drawn from the step's rng: reproducible
        out["content"] = out["content"] + rng.normal(0, 0.5, out["content"].shape)
    return out


class Net(torch.nn.Linear):
    def __init__(self) -> None:
        torch.manual_seed(0)
        super().__init__(WIDTH, CLASSES, dtype=torch.float64)


class FailsOnce(Net):
    """Raises once, on partition 1 at its 5th training step (after checkpoints exist)."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker, self.calls = marker, 0

    def forward(self, x):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and self.training:
            self.calls += 1
            if self.calls == 5 and ctx.partitionId() == 1 and not os.path.exists(self.marker):
                open(self.marker, "w").close()
                raise ValueError("injected failure in forward")
        return super().forward(x)


@pytest.fixture(scope="module")
def records(spark):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(ROWS, WIDTH))
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
    rows = [(bytearray(x[i].tobytes()), x[i].tolist(), int(y[i]), f"/data/{i}.bin")
            for i in range(ROWS)]
    return spark.createDataFrame(rows, "content binary, vector array<double>, label long, "
                                       "path string").cache()


def _fit(df, model_fn=Net, preprocess=_decode, **fields):
    return fit(df, model_fn, TrainConfig(**{**SYNC, **fields}), features_col="content",
               preprocess=preprocess, eval_df=df)


# --- without Spark ---------------------------------------------------------------------

ENCODED = FieldSpec("input", "content", "content", "_x0", "uint8", (-1,), "binary", True)
LABEL = FieldSpec("label", "label", "label", "_y0", "int64", ())


def test_binary_arrow_column_reads_without_a_copy_per_row():
    sliced = pa.array([b"ab", b"", b"xyz", b"q"])[1:]  # an offset into the buffers
    column = read_column(sliced, ENCODED)
    assert column.values.tobytes() == b"xyzq" and column.lengths.tolist() == [0, 3, 1]
    large = read_column(pa.array([b"ab", b"c"], pa.large_binary()), ENCODED)
    assert large.values.tobytes() == b"abc" and large.lengths.tolist() == [2, 1]
    with pytest.raises(DataError, match="nulls"):
        read_column(pa.array([b"a", None]), ENCODED)


def test_the_model_schema_comes_from_what_preprocess_returns():
    raw = DataSchema(inputs=(ENCODED,), binding="single", labels=(LABEL,), label_list=False)
    values = np.frombuffer(np.arange(2 * WIDTH, dtype=np.float64).tobytes(), np.uint8)
    parts = [(values, np.array([8 * WIDTH, 8 * WIDTH])), np.array([1, 2])]
    batch = raw_batch(raw, parts)
    assert batch["content"][1] == np.arange(WIDTH, 2 * WIDTH, dtype=np.float64).tobytes()
    schema = model_schema(raw, _decode(batch, training=False, rng=None), 2)
    assert (schema.inputs[0].dtype, schema.inputs[0].shape) == ("float32", (WIDTH,))
    assert schema.labels == raw.labels  # not returned: as carried
    out = Preprocessor(_decode, raw, schema, torch.float64, seed=0, partition=0)(
        [parts], training=True, rng=step_rng(0, 0, 0, 0))
    assert out.inputs[0].dtype == torch.float64 and out.inputs[0][1, 0] == WIDTH
    with pytest.raises(DataError, match="decoded"):
        model_schema(raw, {"label": np.zeros(2)}, 2)
    with pytest.raises(DataError, match="does not name"):
        model_schema(raw, {"content": np.zeros((2, 1)), "other": np.zeros(2)}, 2)
    with pytest.raises(DataError, match="rows first"):
        model_schema(raw, {"content": np.zeros((3, 1))}, 2)


def test_a_ragged_column_not_returned_reaches_the_model_padded():
    tokens = FieldSpec("input", "tokens", "tokens", "_x1", "int32", (-1,))
    raw = DataSchema(inputs=(ENCODED, tokens), binding="positional", labels=(LABEL,),
                     label_list=False)
    parts = [(np.frombuffer(b"ab", np.uint8), np.array([1, 1])),
             (np.array([4, 5, 6], np.int32), np.array([1, 2])), np.array([0, 1])]

    def decode(batch, *, training, rng):
        assert [t.tolist() for t in batch["tokens"]][:2] == [[4], [5, 6]]
        return {"content": np.array([[c[0]] for c in batch["content"]], np.float32)}

    schema = model_schema(raw, decode(raw_batch(raw, parts), training=False, rng=None), 2)
    out = Preprocessor(decode, raw, schema, torch.float32, seed=0, partition=0)(
        [parts[:], parts], training=True, rng=None)  # two pieces, one after another
    assert out.inputs[0][:, 0].tolist() == [97.0, 98.0, 97.0, 98.0]
    assert out.inputs[1].tolist() == [[4, 0], [5, 6], [4, 0], [5, 6]]
    assert out.inputs[1].dtype == torch.int64 and (out.padded, out.positions) == (2, 8)


def test_the_rng_is_a_function_of_seed_epoch_partition_and_batch():
    draw = [step_rng(*key).random() for key in [(1, 0, 0, 0), (1, 0, 0, 0), (1, 0, 0, 1),
                                                (1, 1, 0, 0), (1, 0, 1, 0), (2, 0, 0, 0)]]
    assert draw[0] == draw[1] and len(set(draw)) == 5


# --- fits -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoded(records):
    """The reference: the same numbers as an array column, no preprocess."""
    return fit(records, Net, TrainConfig(**SYNC), features_col="vector", eval_df=records)


@pytest.mark.spark
@pytest.mark.parametrize("cache", ["memory", "disk"])
@pytest.mark.exact
def test_decoding_bytes_trains_as_the_numbers_do(records, decoded, cache):
    result = _fit(records, data_cache=cache)
    assert {w["cache"] for w in result.workers} == {cache}
    # the feed's metrics: raw MB/s read from the cache, the training thread's wait
    assert all(w["read_mb_s"] > 0 and w["batch_wait_s"] > 0 for w in result.workers)
    assert same_parameters(result.model, decoded.model)
    assert not same_parameters(result.model, Net())  # it trained
    # evaluation decodes too (training=False): the same losses each round (round 0 too)
    losses = [h["eval_loss"] for h in result.history if "eval_loss" in h]
    assert len(losses) == 3 and losses == [h["eval_loss"] for h in decoded.history
                                           if "eval_loss" in h]


@pytest.mark.spark
@pytest.mark.exact
def test_async_lockstep_decodes_as_sync_does(records, decoded):
    lockstep = fit(records, Net, TrainConfig(**COMMON, mode="async", push_every=2,
                                             staleness_bound=0),
                   features_col="content", preprocess=_decode)
    assert max((a - b).abs().max().item() for a, b in
               zip(lockstep.model.parameters(), decoded.model.parameters(), strict=True)) < 1e-10


@pytest.fixture(scope="module")
def augmented(records):
    """Logged too: its MLflow model carries the preprocess (training=False when scoring)."""
    return _fit(records, preprocess=_augment, log_model=True)


@pytest.mark.spark
def test_augmentation_through_rng_is_reproducible(records, decoded, augmented):
    again = _fit(records, preprocess=_augment)
    assert same_parameters(again.model, augmented.model)
    assert not same_parameters(augmented.model, decoded.model)  # the noise counted


@pytest.mark.spark
def test_a_restart_replays_the_augmentation_bit_identically(records, augmented, tmp_path):
    marker = str(tmp_path / "fired")
    result = _fit(records, partial(FailsOnce, marker), preprocess=_augment,
                  checkpoint_every=1)
    assert os.path.exists(marker) and len(result.failures) == 1
    assert result.failures[0]["restart_at"] != "round 0"  # mid-fit, from a checkpoint
    assert same_parameters(result.model, augmented.model)


class SlowStep(Net):
    def forward(self, x):
        if self.training:
            time.sleep(0.025)  # a ~25 ms step
        return super().forward(x)


def _sleepy(batch, *, training, rng):
    time.sleep(0.025)
    return _decode(batch, training=training, rng=rng)


@pytest.mark.spark
def test_preprocess_runs_beside_the_training_step(records, mlflow_client):
    slow = dict(num_workers=1, epochs=5, batch_size=8, averaging_frequency=60)
    instant = _fit(records, SlowStep, **slow)
    sleepy = _fit(records, SlowStep, preprocess=_sleepy, **slow)
    steps = 5 * ROWS // 8
    assert instant.timings["train_s"] > steps * 0.025  # the steps did sleep
    # serially each step would cost about 50 ms: about 2x
    assert sleepy.timings["train_s"] <= 1.3 * instant.timings["train_s"]
    # batch_wait_s: one thread preprocessing 25 ms a batch for an instant step keeps the
    # training thread waiting about 25 ms a step; the instant preprocess, for little
    serial = _fit(records, preprocess=_sleepy, num_workers=1, epochs=1, batch_size=8,
                  averaging_frequency=12, preprocess_threads=1)
    per_step = serial.workers[0]["batch_wait_s"] / (ROWS // 8)
    assert per_step > 0.025 / 2 and per_step > 4 * instant.workers[0]["batch_wait_s"] / steps
    metrics = mlflow_client.get_run(serial.run_id).data.metrics  # the docs' MLflow metric
    assert metrics["worker_0_batch_wait_s"] == pytest.approx(serial.workers[0]["batch_wait_s"])


@pytest.mark.spark
def test_binary_columns_need_a_preprocess(records):
    with pytest.raises(DataError, match="preprocess="):
        fit(records, Net, TrainConfig(**SYNC), features_col="content")
    with pytest.raises(DataError, match="weight column 'content' is binary"):
        fit(records, Net, TrainConfig(**SYNC), features_col="vector", weight_col="content",
            preprocess=_decode)
    # a preprocess that fails on every row: the sample's first row named, and the others
    with pytest.raises(PreprocessError, match=re.escape(
            "preprocess failed on the row whose path is '/data/0.bin' (row 0 of train_df's "
            "first 4 rows): ZeroDivisionError('division by zero'); the batch's other rows "
            "fail without it too")):
        _fit(records, preprocess=lambda batch, **_: 1 / 0)


def _fails_in_training(log: str, batch, *, training, rng):
    first = step_rng(COMMON["seed"], 0, 0, 0).bit_generator.state
    if training and rng.bit_generator.state == first:  # the first step: once an attempt
        if len(batch["content"]) == SYNC["batch_size"]:  # not the search for its row
            with open(log, "a") as f:
                f.write("raised\n")
        raise ValueError("corrupt record")
    return _decode(batch, training=training, rng=rng)


@pytest.mark.spark
def test_a_preprocess_that_raises_fails_the_fit_once(records, tmp_path, mlflow_client):
    log = tmp_path / "raised"
    with pytest.raises(PreprocessError, match="corrupt record"):
        _fit(records, preprocess=partial(_fails_in_training, str(log)), num_workers=1,
             max_failures=2)
    assert log.read_text() == "raised\n"  # final: not retried
    exp = mlflow_client.get_experiment_by_name("preprocess")
    run = mlflow_client.search_runs([exp.experiment_id],
                                    order_by=["attributes.start_time DESC"])[0]
    assert run.info.status == "FAILED" and "corrupt record" in run.data.tags["error"]


@pytest.mark.spark
def test_transform_preprocesses_the_raw_columns(records, augmented):
    """training=False: the records decoded without noise, then the returned model."""
    scored = augmented.transform(records).select("vector", "prediction").toPandas()
    x = torch.tensor(np.stack(scored["vector"].to_numpy()))
    with torch.no_grad():
        expected = augmented.model(x).argmax(1)
    assert scored["prediction"].tolist() == expected.tolist()
    assert len(set(expected.tolist())) > 1  # not one class for every row


@pytest.mark.spark
def test_the_logged_model_scores_the_raw_bytes(records, augmented):
    """`mlflow.pyfunc.load_model(uri).predict` on a DataFrame of bytes: transform's classes."""
    import mlflow
    import pandas as pd

    scored = augmented.transform(records).select("content", "prediction").toPandas()
    loaded = mlflow.pyfunc.load_model(f"runs:/{augmented.run_id}/model")
    inputs = loaded.metadata.get_input_schema().inputs
    assert [(c.name, c.type.name) for c in inputs] == [("content", "binary")]
    frame = pd.DataFrame({"content": [bytes(b) for b in scored["content"]]})
    assert loaded.predict(frame).tolist() == scored["prediction"].tolist()
    assert len(set(scored["prediction"])) > 1


@pytest.mark.spark
def test_the_logged_model_scores_binary_rows_through_spark_udf(spark, records, augmented):
    import mlflow

    udf = mlflow.pyfunc.spark_udf(spark, f"runs:/{augmented.run_id}/model",
                                  result_type="long", env_manager="local")
    rows = records.select("path", udf("content").alias("out"),
                          augmented.predict_udf()("content").alias("expected")).collect()
    assert len(rows) == ROWS and all(r.out == r.expected for r in rows)
    assert len({r.out for r in rows}) > 1


@pytest.mark.spark
def test_the_spark_ml_model_applies_and_saves_the_preprocess(records, augmented, tmp_path):
    """The estimator fits as `fit` does; its model scores the bytes with training=False,
    saved and loaded with its preprocess."""
    from sparkdl_avg.ml import AveragingEstimator, AveragingModel

    estimator = AveragingEstimator(model_fn=Net, config=TrainConfig(**SYNC),
                                   featuresCol="content", preprocess=_augment)
    model = estimator.fit(records)
    expected = augmented.transform(records).select("prediction").toPandas()["prediction"]
    assert model.transform(records).toPandas()["prediction"].tolist() == expected.tolist()
    model.save(str(tmp_path / "model"))
    loaded = AveragingModel.load(str(tmp_path / "model"))
    again = loaded.transform(records).select("prediction", "probability").toPandas()
    assert again["prediction"].tolist() == expected.tolist()


def _decode_logged(log: str, batch, *, training, rng):
    try:
        return _decode(batch, training=training, rng=rng)
    except ValueError:
        with open(log, "a") as f:
            f.write("raised\n")
        raise


@pytest.mark.spark
@pytest.mark.parametrize("ident", ["path string", "id long"])
def test_a_corrupt_record_fails_the_fit_once_naming_its_path(spark, tmp_path, mlflow_client,
                                                            ident):
    """One truncated record among 12: the fit fails once (final), the error naming its
    `path` (or an integer `id`), and the run is FAILED."""
    x = np.random.default_rng(2).normal(size=(12, WIDTH))
    name = ident.split()[0]
    names = [f"/data/{i}.bin" if name == "path" else 1000 + i for i in range(12)]
    rows = [(bytearray(x[i].tobytes()[:5] if i == 11 else x[i].tobytes()), i % 2, names[i])
            for i in range(12)]
    df = spark.createDataFrame(rows, f"content binary, label long, {ident}")
    log = tmp_path / "raised"
    with pytest.raises(PreprocessError, match=re.escape(f"row whose {name} is '{names[11]}'")):
        fit(df, Net, TrainConfig(**{**SYNC, "num_workers": 1, "batch_size": 1,
                                    "epochs": 1, "max_failures": 2}),
            features_col="content", preprocess=partial(_decode_logged, str(log)))
    assert log.read_text() == "raised\n"  # final: not retried
    exp = mlflow_client.get_experiment_by_name("preprocess")
    run = mlflow_client.search_runs([exp.experiment_id],
                                    order_by=["attributes.start_time DESC"])[0]
    assert run.info.status == "FAILED" and str(names[11]) in run.data.tags["error"]


def _hangs_in_training(log: str, batch, *, training, rng):  # a decoder stuck on a record
    if training:
        with open(log, "a") as f:
            f.write("hung\n")
        time.sleep(8)
    return _decode(batch, training=training, rng=rng)


@pytest.mark.spark
def test_a_preprocess_that_hangs_stops_the_fit_with_a_reason(records, tmp_path):
    log = tmp_path / "hung"
    with pytest.raises(PreprocessError, match=r"took more than 2.4 s \(0.8 x round_timeout\)"):
        _fit(records, preprocess=partial(_hangs_in_training, str(log)), num_workers=1,
             round_timeout=3.0, prefetch_batches=1, preprocess_threads=1, max_failures=2)
    assert log.read_text() == "hung\n"  # final: the task was not run again


def test_a_returned_batch_may_change_length_but_not_its_number_of_dimensions():
    """A tokenizer pads to each batch's longest row: the sample's length is not the rule."""
    raw = DataSchema(inputs=(ENCODED,), binding="single", labels=(LABEL,), label_list=False,
                     weight=None, float_dtype="float64")
    sample = model_schema(raw, {"content": np.zeros((2, 5))}, 2)
    prep = Preprocessor(lambda b, **_: {"content": np.zeros((len(b["content"]), 7))}, raw,
                        sample, torch.float64, seed=0, partition=0)
    parts = [(np.zeros(6, np.uint8), np.array([3, 3])), np.array([0, 1])]
    assert prep([parts], training=False, rng=step_rng(0, 0, 0, 0)).inputs[0].shape == (2, 7)
    flat = Preprocessor(lambda b, **_: {"content": np.zeros(len(b["content"]))}, raw,
                        sample, torch.float64, seed=0, partition=0)
    with pytest.raises(DataError, match=r"shape \(\) for .*sample gave \(5,\)"):
        flat([parts], training=False, rng=step_rng(0, 0, 0, 0))
    rows = Preprocessor(lambda b, **_: {"content": [np.zeros(2), np.zeros(3)]}, raw,
                        sample, torch.float64, seed=0, partition=0)
    with pytest.raises(DataError, match="not one array"):
        rows([parts], training=False, rng=step_rng(0, 0, 0, 0))


def _threads_in_evaluation(log: str, batch, *, training, rng):
    from pyspark import TaskContext

    if not training and TaskContext.get() is not None:  # not the driver's sample
        import threading

        with open(log, "a") as f:
            f.write(threading.current_thread().name + "\n")
    return _decode(batch, training=training, rng=rng)


@pytest.mark.spark
@pytest.mark.exact
def test_evaluation_preprocesses_on_the_pool(records, decoded, tmp_path):
    """Evaluation's chunks are decoded off the training thread, on a pool of their own
    (not training's, whose threads stay busy prefetching steps), with the same losses as the
    numbers give."""
    log = tmp_path / "threads"
    result = _fit(records, preprocess=partial(_threads_in_evaluation, str(log)),
                  eval_batch_size=16, data_cache="disk")
    names = log.read_text().split()
    # 3 evaluations (round 0, each epoch's end) x 2 workers x 3 chunks of 16 of their 48 rows
    assert len(names) == 18 and {n.rpartition("_")[0] for n in names} == \
        {"sparkdl-avg-preprocess-eval"}
    # chunks of 16 here, of all 48 rows there: other sums, other kernels; per row a dot of
    # WIDTH + 1 terms and a log-sum-exp of CLASSES (an exp and a log each), all about 1
    rel = sum_tolerance(torch.float64, ROWS * (WIDTH + 1 + 2 * CLASSES))
    assert [h["eval_loss"] for h in result.history if "eval_loss" in h] == pytest.approx(
        [h["eval_loss"] for h in decoded.history if "eval_loss" in h], rel=rel, abs=0)


class Embedded(torch.nn.Module):
    """A record's numbers and an id through an embedding of 5; marks `marker` if it trains."""

    def __init__(self, marker: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.marker = marker
        self.linear = torch.nn.Linear(WIDTH, CLASSES, dtype=torch.float64)
        self.ids = torch.nn.Embedding(5, CLASSES, dtype=torch.float64)

    def forward(self, x, ids):
        if self.training:
            open(self.marker, "w").close()
        elif not x.any():  # the probe must run on the decoded sample, not on zeros
            raise ValueError("probed on zeros")
        return self.linear(x) + self.ids(ids)


@pytest.mark.spark
@pytest.mark.parametrize("driver_model", ["full", "meta"])
def test_an_id_beyond_its_embedding_is_refused_before_training(spark, tmp_path,
                                                               driver_model):
    """The id column passes through preprocess: the probe on the sample still holds its
    largest id, beyond the embedding's 5, though the sample's first rows hold 0..3; with
    driver_model="meta" the executor that builds the model probes it on the sample shipped
    from the driver (the model refuses a probe of zeros)."""
    x = np.random.default_rng(3).normal(size=(24, WIDTH))
    rows = [(bytearray(x[i].tobytes()), i % 4 if i < 23 else 9, i % 2) for i in range(24)]
    df = spark.createDataFrame(rows, "content binary, ids long, label long")
    marker = tmp_path / "trained"
    with pytest.raises(ModelError, match="out of range.*ids.* up to 9"):
        fit(df, partial(Embedded, str(marker)), TrainConfig(**SYNC, driver_model=driver_model),
            inputs=["content", "ids"], preprocess=_decode)
    assert not marker.exists()  # refused by the probe: no task trained


@pytest.mark.spark
def test_a_meta_driver_fits_with_a_preprocess_as_the_full_driver_does(records, augmented):
    """driver_model="meta": the executor's build probes the model on the driver's sample
    (a probe of the raw bytes would fail in Linear), and trains bit-identically."""
    meta = _fit(records, preprocess=_augment, log_model=True, driver_model="meta")
    assert same_parameters(meta.model, augmented.model)
