"""`fit(preprocess=)`'s feed without Spark (issue 31, the training side): evaluation chunks
preprocessed on the pool, in order, its threads gone on every way out; integers kept at
fn's width to the device and widened there to what the model gets; the probe's sample
carrying the ranges of the integer columns preprocess passes through."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from sparkdl_avg import PreprocessError
from sparkdl_avg.data.cache import batch_of, tensors_of
from sparkdl_avg.data.feed import (
    PreprocessFeed,
    Preprocessor,
    eval_jobs,
    model_schema,
    raw_batch,
    step_rng,
)
from sparkdl_avg.data.probe_batch import passed_ranges, with_ranges
from sparkdl_avg.data.schema import DataSchema, FieldSpec

X = FieldSpec("input", "x", "x", "_x0", "float64", (2,))
IDS = FieldSpec("input", "ids", "ids", "_x1", "int32", ())
IMAGE = FieldSpec("input", "content", "content", "_x2", "uint8", (-1,), "binary", True)
LABEL = FieldSpec("label", "label", "label", "_y0", "int64", ())
POOL = "sparkdl-avg-preprocess"


class Rows:
    """An evaluation cache's `parts`: row r's x is (r, -r), its label r % 3."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def parts(self, size: int):
        for start in range(0, self.rows, size):
            r = np.arange(start, min(start + size, self.rows))
            yield [np.stack([r, -r], 1).astype(np.float64), r % 3]


def _feed_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(POOL)]


def _gone(timeout: float = 5.0) -> bool:
    """The feed's threads have ended (an idle pool thread ends soon after shutdown)."""
    end = time.monotonic() + timeout
    while _feed_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return not _feed_threads()


def _eval_feed(fn, rows: int = 10, size: int = 3, **settings):
    raw = DataSchema(inputs=(X,), binding="single", labels=(LABEL,), label_list=False,
                     float_dtype="float64")
    prep = Preprocessor(fn, raw, raw, torch.float64, seed=7, partition=1)
    settings = {"threads": 2, "prefetch": 2, **settings}
    return PreprocessFeed(eval_jobs(Rows(rows), size, 7, 1), prep, torch.device("cpu"),
                          **settings)


def test_evaluation_chunks_are_preprocessed_on_the_pool_in_order():
    seen = []

    def fn(batch, *, training, rng):
        seen.append((threading.current_thread().name, training, rng.random()))
        time.sleep(0.01 * (batch["x"][0, 0] % 2))  # odd chunks finish late: order kept
        return {"x": batch["x"] * 2}

    assert _gone()
    with _eval_feed(fn) as feed:
        chunks = list(feed)
    assert [c.rows for c in chunks] == [3, 3, 3, 1]
    assert torch.cat([c.inputs[0] for c in chunks])[:, 0].tolist() == \
        [2.0 * r for r in range(10)]
    assert torch.cat([c.labels[0] for c in chunks]).tolist() == [r % 3 for r in range(10)]
    assert {name.rpartition("_")[0] for name, _, _ in seen} == {POOL}
    assert not any(training for _, training, _ in seen)
    # each chunk's rng is fixed by its index, whichever thread runs it
    assert sorted(d for *_, d in seen) == sorted(step_rng(7, 1 << 31, 1, k).random()
                                                 for k in range(4))
    assert _gone()


def test_the_evaluation_feed_stops_its_threads_on_every_way_out():
    with _eval_feed(lambda batch, **_: batch) as feed:  # left after one chunk of four
        assert next(iter(feed)).rows == 3
    assert _gone()
    with pytest.raises(RuntimeError, match="the model"), \
            _eval_feed(lambda batch, **_: batch) as feed:
        next(iter(feed))
        raise RuntimeError("the model failed on a chunk")
    assert _gone()

    def broken(batch, *, training, rng):
        raise ValueError("corrupt record")

    with pytest.raises(PreprocessError, match="corrupt record"), _eval_feed(broken) as feed:
        list(feed)
    assert _gone()


def _images(batch, *, training, rng):
    """uint8 pixels, as a decoder gives them."""
    return {"content": np.stack([np.frombuffer(b, np.uint8) for b in batch["content"]])}


def test_integers_cross_to_the_device_at_the_width_preprocess_returns():
    """With `narrow` (a GPU's copy), the host batch keeps fn's uint8 (and a pass-through
    int32 column its 4 bytes); on the device it is what the model gets (int64), the same
    numbers as widening on the host."""
    raw = DataSchema(inputs=(IMAGE, IDS), binding="positional", labels=(LABEL,),
                     label_list=False)
    pixels = np.array([[0, 7, 255], [128, 1, 2]], np.uint8)
    parts = [(pixels.reshape(-1), np.array([3, 3])), np.array([5, 70000], np.int32),
             np.array([1, 2])]
    schema = model_schema(raw, _images(raw_batch(raw, parts), training=False, rng=None), 2)
    assert [f.dtype for f in schema.fields] == ["int64", "int32", "int64"]  # what it gets
    rng = step_rng(0, 0, 0, 0)
    wide = Preprocessor(_images, raw, schema, torch.float32, seed=0, partition=0)(
        [parts], training=True, rng=rng)
    prep = Preprocessor(_images, raw, schema, torch.float32, seed=0, partition=0,
                        narrow=True)
    host = prep([parts], training=True, rng=rng)
    assert [t.dtype for t in tensors_of(host)] == [torch.uint8, torch.int32, torch.int64]
    assert host.nbytes == 6 + 8 + 16  # 1/8 of the pixels' int64 bytes
    jobs = iter([([parts], True, rng)])
    with PreprocessFeed(jobs, prep, torch.device("cpu"), threads=1, prefetch=1) as feed:
        got = feed.get()
        assert feed.get() is None
    assert [t.dtype for t in tensors_of(got)] == [torch.int64] * 3
    assert all(torch.equal(a, b) for a, b in zip(tensors_of(got), tensors_of(wide),
                                                 strict=True))


def test_the_probe_sample_holds_the_ranges_of_the_columns_preprocess_passes_through():
    raw = DataSchema(inputs=(IMAGE, IDS), binding="positional", labels=(LABEL,),
                     label_list=False)
    schema = model_schema(raw, {"content": np.zeros((1, 3), np.float32)}, 1)
    ranges = {"_x1": (0.0, 9.0), "_y0": (0.0, 2.0), "_x2": (0.0, 255.0)}
    # the image is returned (decoded: its bytes' range says nothing); the rest pass through
    passed = passed_ranges(raw, schema, ranges)
    assert passed == {"_x1": (0.0, 9.0), "_y0": (0.0, 2.0)}
    assert passed_ranges(raw, None, ranges) == ranges
    sample = batch_of(schema, [torch.full((1, 3), 0.5), torch.tensor([3]), torch.tensor([1])])
    probe = with_ranges(sample, schema, low={"_x1": 0, "_y0": 0}, high={"_x1": 9, "_y0": 2})
    assert probe.inputs[0].tolist() == [[0.5] * 3] * 2  # one real row, repeated
    assert probe.inputs[1].tolist() == [0, 9] and probe.labels[0].tolist() == [0, 2]
    assert sample.inputs[1].tolist() == [3]  # the sample is left as it was
