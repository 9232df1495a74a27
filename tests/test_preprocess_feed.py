"""`fit(preprocess=)`'s feed without Spark (issue 31, the training side): evaluation chunks
preprocessed on a pool of their own, in order, one chunk ahead, its threads gone on every way
out; a stopped feed starting no more calls; no minibatch past the last step; integers kept at
fn's width to the device and widened there to what the model gets (the replica's choice);
the probe's sample carrying the ranges of the integer columns preprocess passes through,
left as it was, and shipped as its two rows alone."""

from __future__ import annotations

import pickle
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from sparkdl_avg import PreprocessError
from sparkdl_avg.data.batches import TrainBatches
from sparkdl_avg.data.cache import batch_of, tensors_of
from sparkdl_avg.data.feed import (
    PreprocessFeed,
    Preprocessor,
    eval_feed,
    eval_jobs,
    model_schema,
    step_rng,
)
from sparkdl_avg.data.order import Cut
from sparkdl_avg.data.probe_batch import first_rows, passed_ranges, with_ranges
from sparkdl_avg.data.raw_rows import raw_batch
from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.task.replica import _preprocessor

X = FieldSpec("input", "x", "x", "_x0", "float64", (2,))
IDS = FieldSpec("input", "ids", "ids", "_x1", "int32", ())
IMAGE = FieldSpec("input", "content", "content", "_x2", "uint8", (-1,), "binary", True)
LABEL = FieldSpec("label", "label", "label", "_y0", "int64", ())
FLAG = FieldSpec("input", "flag", "flag", "_x3", "bool", ())
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


def test_a_stuck_preprocess_stops_the_feed_with_python_3_10s_timeout_class(monkeypatch):
    """On Python 3.10 a future's `result(timeout=)` raises `concurrent.futures.TimeoutError`,
    which is not the builtin TimeoutError (3.11 made them one class): a stand-in of that
    kind, raised by the future itself, still stops the feed with a PreprocessError saying
    why, not an exception the feed lets through."""
    import concurrent.futures
    import concurrent.futures._base as futures_base

    class FuturesTimeout(Exception):  # as 3.10 has it: no subclass of the builtin
        pass

    monkeypatch.setattr(futures_base, "TimeoutError", FuturesTimeout)  # what result() raises
    monkeypatch.setattr(concurrent.futures, "TimeoutError", FuturesTimeout)
    release = threading.Event()

    def stuck(batch, **_):  # a decoder stuck on a record, until the test ends
        release.wait(10)
        return batch

    try:
        with pytest.raises(PreprocessError, match="took more than"), \
                _eval_feed(stuck, timeout=0.2) as feed:
            feed.get()
    finally:
        release.set()
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


def test_evaluation_holds_at_most_two_chunks_beyond_the_one_evaluated():
    """`eval_feed` (what a replica evaluates through) prefetches one chunk, on a pool named
    for evaluation, with training's threads: a consumer slower than `fn` finds at most 3
    chunks decoded and not yet evaluated (training's prefetch_batches=4 would give 6)."""
    started, done, most = [], [0], [0]

    def fn(batch, *, training, rng):
        started.append(threading.current_thread().name)
        most[0] = max(most[0], len(started) - done[0])
        return batch

    raw = DataSchema(inputs=(X,), binding="single", labels=(LABEL,), label_list=False,
                     float_dtype="float64")
    prep = Preprocessor(fn, raw, raw, torch.float64, seed=7, partition=1)
    with eval_feed(Rows(30), 3, prep, torch.device("cpu"), threads=2, timeout=60) as feed:
        for _ in feed:
            time.sleep(0.02)  # the model's forward on the chunk
            done[0] += 1
    assert done[0] == 10 and most[0] <= 3
    assert {name.rpartition("_")[0] for name in started} == {POOL + "-eval"}
    assert _gone()


def test_a_stopped_feed_starts_no_more_calls():
    """The producer checks `stopped` before each submit: a job gathered while the feed
    stops is not preprocessed (it would outlive the feed's `stop`)."""
    submitted = []

    def jobs():
        for k, parts in enumerate(Rows(9).parts(3)):
            if k == 1:
                feed.stopped.set()  # as `stop` does, while the producer gathers job 1
            yield [parts], False, step_rng(0, 0, 0, k)

    feed = _eval_feed(lambda batch, **_: batch)
    feed.jobs = jobs()
    submit = feed.pool.submit
    feed.pool.submit = lambda *a, **kw: submitted.append(1) or submit(*a, **kw)
    feed.start()
    feed.thread.join(5)
    feed.stop()
    assert len(submitted) == 1
    assert _gone()


def test_training_batches_past_the_last_step_raise():
    """The feed's end is no minibatch: a step beyond `total_steps` raises, as the disk
    cache's producer does, instead of handing the training loop None."""

    class Memory:
        in_memory, rows, assemble_s, assembled_bytes = True, 6, 0.0, 0

        def part(self, index):
            return [np.stack([index, -index], 1).astype(np.float64), index % 3]

    raw = DataSchema(inputs=(X,), binding="single", labels=(LABEL,), label_list=False,
                     float_dtype="float64")
    prep = Preprocessor(lambda batch, **_: batch, raw, raw, torch.float64, seed=0,
                        partition=0)
    batches = TrainBatches(Memory(), cut=Cut(6, 1), seed=0, worker=0, shuffle=False,
                           batch_size=3, steps_per_epoch=2, total_steps=2,
                           device=torch.device("cpu"), preprocess=prep, threads=1,
                           prefetch=1)
    batches.start(0)
    try:
        assert [batches.next().rows for _ in range(2)] == [3, 3]
        with pytest.raises(RuntimeError, match="no minibatch at step 2: the fit has 2"):
            batches.next()
    finally:
        batches.close()
    assert _gone()


@pytest.mark.parametrize(("device", "narrow"), [("cpu", False), ("meta", True)])
def test_a_replica_keeps_integers_narrow_only_for_a_copy_to_another_device(device, narrow):
    """The replica's choice (`replica._preprocessor`): on the CPU the pool converts to the
    model's dtypes at once; for any other device (a GPU, here "meta": no CUDA needed)
    integers stay narrow until the copy. Pinned memory is for CUDA alone."""
    import cloudpickle

    raw = DataSchema(inputs=(IMAGE,), binding="single", labels=(LABEL,), label_list=False)
    spec = SimpleNamespace(preprocess=cloudpickle.dumps(_images), schema=raw,
                           model_schema=raw)
    prep = _preprocessor(spec, SimpleNamespace(seed=3), 1, torch.float32,
                         torch.device(device))
    assert (prep.narrow, prep.pin, prep.seed, prep.partition) == (narrow, False, 3, 1)


def _images(batch, *, training, rng):
    """uint8 pixels, as a decoder gives them."""
    return {"content": np.stack([np.frombuffer(b, np.uint8) for b in batch["content"]])}


def test_integers_cross_to_the_device_at_the_width_preprocess_returns():
    """With `narrow` (a GPU's copy), the host batch keeps fn's uint8 (and a pass-through
    int32 column its 4 bytes); on the device it is what the model gets (uint8 pixels stay
    uint8, the ids and the label int64), the same numbers as converting on the host."""
    raw = DataSchema(inputs=(IMAGE, IDS), binding="positional", labels=(LABEL,),
                     label_list=False)
    pixels = np.array([[0, 7, 255], [128, 1, 2]], np.uint8)
    parts = [(pixels.reshape(-1), np.array([3, 3])), np.array([5, 70000], np.int32),
             np.array([1, 2])]
    schema = model_schema(raw, _images(raw_batch(raw, parts), training=False, rng=None), 2)
    assert [f.dtype for f in schema.fields] == ["uint8", "int32", "int64"]  # what it gets
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
    assert [t.dtype for t in tensors_of(got)] == [torch.uint8, torch.int64, torch.int64]
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
    one = batch_of(schema, [torch.full((1, 3), 0.5), torch.tensor([3]), torch.tensor([1])])
    probe = with_ranges(one, schema, low={"_x1": 0, "_y0": 0}, high={"_x1": 9, "_y0": 2})
    assert probe.inputs[0].tolist() == [[0.5] * 3] * 2  # one real row, repeated
    assert probe.inputs[1].tolist() == [0, 9] and probe.labels[0].tolist() == [0, 2]


def test_the_probe_leaves_its_sample_as_it_was():
    """A sample of two rows (the probe's own number: nothing is repeated, so nothing is
    copied on the way) keeps its values; a negative least id goes in; a bool field, whose
    range validation knows too, is no integer column and stays as it was."""
    raw = DataSchema(inputs=(IMAGE, IDS, FLAG), binding="positional", labels=(LABEL,),
                     label_list=False)
    schema = model_schema(raw, {"content": np.zeros((2, 3), np.float32)}, 2)
    ranges = {"_x1": (-3.0, 9.0), "_x3": (0.0, 1.0), "_y0": (0.0, 2.0)}
    passed = passed_ranges(raw, schema, ranges)
    low = {w: int(r[0]) for w, r in passed.items()}
    high = {w: int(r[1]) for w, r in passed.items()}
    sample = batch_of(schema, [torch.full((2, 3), 0.5), torch.tensor([3, 4]),
                               torch.tensor([True, True]), torch.tensor([1, 1])])
    probe = with_ranges(sample, schema, low=low, high=high)
    assert probe.inputs[1].tolist() == [-3, 9] and probe.labels[0].tolist() == [0, 2]
    assert probe.inputs[2].tolist() == [True, True]
    assert sample.inputs[1].tolist() == [3, 4] and sample.labels[0].tolist() == [1, 1]
    assert sample.inputs[2].tolist() == [True, True]


def test_the_probe_ships_two_rows_not_the_buffer_they_were_cut_from():
    """`first_rows` copies: a view of a sample's two rows would pickle the whole sample
    to the executor that probes (driver_model="meta")."""
    schema = DataSchema(inputs=(X,), binding="single", labels=(LABEL,), label_list=False,
                        float_dtype="float64")
    big = batch_of(schema, [torch.ones(10_000, 2, dtype=torch.float64),
                            torch.zeros(10_000, dtype=torch.int64)])
    cut = first_rows(big)
    assert [t.shape[0] for t in tensors_of(cut)] == [2, 2]
    assert len(pickle.dumps(cut)) < 10_000  # the whole is 240 kB
