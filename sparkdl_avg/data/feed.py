"""Minibatches through the user's `fit(preprocess=fn)`, off the training thread.

The data cache holds the raw rows (an encoded column as bytes, numbers as carried) on the
host. `PreprocessFeed` runs a producer thread that gathers the raw rows of each batch in order
(a training step's from either cache, the same pieces `batches.TrainBatches` would index:
`batches.train_jobs`; or an evaluation chunk's: `eval_jobs`) and submits `preprocess` and the
conversion to tensors to a pool of `TrainConfig.preprocess_threads` threads; the training
thread takes the results in order from a queue of at most `TrainConfig.prefetch_batches`
futures, so the raw batches in flight stay bounded. Decoders that release the GIL (PIL,
numpy, zlib) then run beside the training step, and evaluation's beside its forwards.

A step's `rng` is a pure function of (seed, epoch, partition, batch in the epoch): random
augmentation is reproducible, and a restart replays it bit-identically.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np

from sparkdl_avg._errors import DataError, PreprocessError
from sparkdl_avg.data.arrow_columns import pad
from sparkdl_avg.data.cache import batch_of, typed
from sparkdl_avg.data.ragged import longest, pad_counts
from sparkdl_avg.data.raw_rows import call, join_parts, rows_of
from sparkdl_avg.data.schema import Batch, DataSchema, FieldSpec

_POLL_S = 1.0
POOL = "sparkdl-avg-preprocess"
"""The pool threads' name prefix (training's; evaluation's adds "-eval")."""
EVAL_STREAM = 1 << 31
"""The rng's second word in evaluation (no epoch reaches it): a chunk's rng differs from
every training step's."""


def step_rng(seed: int, epoch: int, partition: int, batch: int) -> np.random.Generator:
    """The rng `preprocess` gets for a training minibatch (or an evaluation chunk: epoch
    `EVAL_STREAM`)."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(
        [seed, epoch, partition, batch])))


def _as_array(value, field: FieldSpec, rows: int) -> np.ndarray:
    import torch

    try:
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu()
            array = (value.float() if value.dtype == torch.bfloat16 else value).numpy()
        else:
            array = np.asarray(value)
    except (TypeError, ValueError) as exc:  # a list of rows of different shapes, say
        raise DataError(f"preprocess returned {type(value).__name__} for {field.described}, "
                        f"which is not one array ({exc}): return one array or tensor, rows "
                        "first, padded to one shape within the batch") from exc
    if array.ndim == 0 or array.shape[0] != rows or array.dtype == object:
        raise DataError(f"preprocess returned {array.shape} {array.dtype} for "
                        f"{field.described}: return an array or tensor with the batch's "
                        f"{rows} rows first")
    return array


def _returned(schema: DataSchema, out, rows: int) -> dict:
    """`preprocess`'s result checked: a dict of the fit's columns, encoded ones decoded."""
    if not isinstance(out, dict):
        raise DataError(f"preprocess must return a dict {{column: array}}, got "
                        f"{type(out).__name__}")
    keys = {f.key: f for f in schema.data_fields}
    unknown = sorted(set(out) - set(keys), key=str)
    if unknown:
        raise DataError(f"preprocess returned {unknown}, which the fit does not name; it "
                        f"returns values for {sorted(keys)}")
    missing = [f.key for f in schema.data_fields if f.encoded and f.key not in out]
    if missing:
        raise DataError(f"preprocess must return {missing} decoded: an encoded column never "
                        "reaches the model as bytes")
    return {k: _as_array(v, keys[k], rows) for k, v in out.items()}


def model_schema(schema: DataSchema, out: dict, rows: int) -> DataSchema:
    """The fields the model gets, from what `preprocess` returned for a sample of rows
    (`out`, by column): a returned field's row shape and kind (floats in the model's float
    dtype, an input's uint8 as uint8, other integers int64, booleans), the others as they
    were carried."""
    out = _returned(schema, out, rows)

    def spec(field: FieldSpec) -> FieldSpec:
        if field.key not in out:
            return field
        array = out[field.key]
        pixels = array.dtype == np.uint8 and field.role == "input"  # a label indexes: int64
        dtype = "bool" if array.dtype == np.bool_ else "uint8" if pixels else "int64" \
            if array.dtype.kind in "iu" else schema.float_dtype if array.dtype.kind == "f" \
            else None
        if dtype is None:
            raise DataError(f"preprocess returned {array.dtype} for {field.described}: "
                            "return numbers or booleans")
        return replace(field, dtype=dtype, shape=tuple(array.shape[1:]), encoded=False,
                       source=f"preprocess: {array.dtype}")

    return DataSchema(inputs=tuple(map(spec, schema.inputs)), binding=schema.binding,
                      labels=tuple(map(spec, schema.labels)), label_list=schema.label_list,
                      weight=spec(schema.weight) if schema.weight else None,
                      float_dtype=schema.float_dtype)


def _tensor(array: np.ndarray):
    """A CPU tensor sharing `array` where torch may (a read-only array, such as one over an
    Arrow buffer or `np.frombuffer`'s, is copied)."""
    import torch

    array = np.ascontiguousarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


NARROW = ("uint8", "int8", "int16", "int32")
"""Integer dtypes a batch may keep on its way to the device (`Preprocessor(narrow=True)`):
each takes the model's dtype there (int64, as the typed inputs' integer columns do; a uint8
input stays uint8)."""


class Preprocessor:
    """`preprocess` and the conversion of its result to tensors on the host: in the model's
    dtypes; with `narrow`, integers returned (or passed through) in a `NARROW` dtype keep it,
    for the copy to the device (`cache.typed` widens them there to int64, while an id
    returned as int16 crosses at 1/4 of int64's bytes); pinned when `pin`."""

    def __init__(self, fn, raw: DataSchema, model: DataSchema, float_dtype, *, seed: int,
                 partition: int, pin: bool = False, narrow: bool = False) -> None:
        self.fn, self.raw, self.model, self.float_dtype = fn, raw, model, float_dtype
        self.seed, self.partition, self.pin, self.narrow = seed, partition, pin, narrow

    def __call__(self, parts: list[list], *, training: bool, rng, offset: int = 0,
                 total: int | None = None) -> Batch:
        """The rows `parts` preprocessed, as the model's Batch. `offset`, `total`: scoring's
        (the batch's first row among the `total` rows given), for an error to name a row
        by its place where the frame has no identifying column."""
        joined = join_parts(self.raw, parts)
        rows = rows_of(joined[0])
        out = call(self.fn, self.raw, joined, training=training, rng=rng,
                   where=self._where(offset, total))
        out = _returned(self.raw, out, rows)
        tensors, padded, positions, made = [], 0, 0, {}
        for raw, field, slot in zip(self.raw.data_fields, self.model.fields, self.raw.slots(),
                                    strict=False):  # the idents come last: left out
            # a column bound as an input and a label: one tensor for both (passed through
            # ragged, each padded with its own pad value)
            key = (slot, raw.pad_value if raw.ragged and field.key not in out else None)
            if key in made:
                tensors.append(made[key])
                continue
            value = joined[slot]
            if field.key in out:
                array = out[field.key]
                # the sample's shape, or another in its dimensions' number: a tokenizer pads
                # to the batch's longest row
                if array.ndim != len(field.shape) + 1:
                    raise DataError(f"preprocess returned rows of shape {array.shape[1:]} for "
                                    f"{field.described}; the fit's sample gave {field.shape}")
                tensor = _tensor(array)
            elif raw.ragged:  # passed through: padded to the batch's longest row
                values, lengths = value
                most = longest(lengths)
                tensor = pad(_tensor(values), _tensor(lengths), raw.pad_value, most)
                if raw.role == "input":
                    pads, all_ = pad_counts(lengths, most)
                    padded, positions = padded + pads, positions + all_
            else:
                tensor = _tensor(value)
            tensor = self._host(tensor, field)
            made[key] = tensor.pin_memory() if self.pin else tensor
            tensors.append(made[key])
        return batch_of(self.model, tensors, padded, positions)

    def _where(self, offset: int, total: int | None):
        def where(k: int | None, rows: int) -> str:
            if total is not None:  # scoring: the rows it was given, in order
                return f"rows {offset} to {offset + rows - 1} of the {total} scored" \
                    if k is None else f"row {offset + k} of the {total} scored"
            batch = f"a batch of {rows} rows of partition {self.partition}"
            return batch if k is None else f"row {k} of {batch}"

        return where

    def _host(self, tensor, field: FieldSpec):
        """`tensor` in the dtype it crosses to the device in."""
        wanted = field.torch_dtype(self.float_dtype)
        if self.narrow and field.kind == "int" and \
                str(tensor.dtype).removeprefix("torch.") in NARROW:
            return tensor
        return tensor.to(wanted)


def next_from(producer, what: str):
    """The next item of `producer.queue`, filled by `producer.thread`; once that thread has
    stopped with nothing left, its `error` as raised (so `is_final` still sees it), else a
    RuntimeError naming `what`."""
    while True:
        try:
            return producer.queue.get(timeout=_POLL_S)
        except queue.Empty:
            if not producer.thread.is_alive() and producer.queue.empty():
                if producer.error is not None:
                    raise producer.error from None
                raise RuntimeError(f"{what} stopped early") from None


class PreprocessFeed:
    """Batches preprocessed on a pool, taken in order by `get` (or by iterating) on the
    consumer's thread, on `device` in the model's dtypes. `jobs` yields each batch's (raw
    parts, training, rng), on the producer thread (`batches.train_jobs`, `eval_jobs`): it
    gathers the raw rows, so reading the cache overlaps the consumer too. A context
    manager: `stop` on every path out."""

    def __init__(self, jobs, preprocessor: Preprocessor, device, *, threads: int,
                 prefetch: int, timeout: float = 600.0, name: str = POOL) -> None:
        self.jobs, self.prep, self.device, self.timeout = jobs, preprocessor, device, timeout
        self.queue: queue.Queue = queue.Queue(prefetch)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
        self.stopped = threading.Event()
        self._submitting = threading.Lock()  # `stop` waits out a submit under way
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name="sparkdl-avg-preprocess-feed")

    def start(self) -> PreprocessFeed:
        self.thread.start()
        return self

    def __enter__(self) -> PreprocessFeed:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def __iter__(self):
        """The batches left, in order."""
        while (batch := self.get()) is not None:
            yield batch

    def get(self) -> Batch | None:
        """The next batch, or None once `jobs` has none left."""
        future = next_from(self, "the preprocess feed")
        if future is None:
            return None
        try:
            batch = future.result(timeout=self.timeout)
        # not the builtin TimeoutError: on Python 3.10 a future's timeout is another class
        except concurrent.futures.TimeoutError:  # a decoder stuck on a record: stuck again
            raise PreprocessError(f"preprocess took more than {self.timeout:.3g} s (0.8 x "
                                  "round_timeout) on one batch: a decoder that hangs "
                                  "(a corrupt record, a network read) stops the fit") from None
        # integers the pool left narrow (`Preprocessor.narrow`) widen on the device
        return typed(batch.to(self.device, non_blocking=True), self.prep.model,
                     self.prep.float_dtype)

    def stop(self) -> None:
        with self._submitting:  # no call starts after this
            self.stopped.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                _cancel(self.queue.get(timeout=0.05))
        self.thread.join()
        while not self.queue.empty():
            _cancel(self.queue.get_nowait())
        # a call still running (a decoder that hangs) is not waited for: its result is dropped
        self.pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        try:
            for parts, training, rng in self.jobs:
                with self._submitting:  # a stopped feed starts no call that outlives it
                    if self.stopped.is_set():
                        return
                    future = self.pool.submit(self.prep, parts, training=training, rng=rng)
                if not self._put(future):  # stopped
                    future.cancel()
                    return
            self._put(None)  # the end
        except BaseException as exc:  # handed to the consumer by get()
            self.error = exc
        finally:  # what the jobs hold (a disk window) goes now, not with the feed
            getattr(self.jobs, "close", lambda: None)()

    def _put(self, item) -> bool:
        """`item` queued, or False once the feed is stopped."""
        while not self.stopped.is_set():
            try:
                self.queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False


def _cancel(future) -> None:
    if future is not None:
        future.cancel()


def eval_feed(columns, size: int, prep: Preprocessor, device, *, threads: int,
              timeout: float) -> PreprocessFeed:
    """Evaluation's chunks of `size` rows as a feed on a pool of its own (named
    `POOL`-eval) with `threads` threads, prefetching one chunk: training's feed keeps its
    `prefetch_batches` steps decoded meanwhile, so evaluation adds at most two decoded chunks
    (one queued, one being decoded) to the one being evaluated."""
    jobs = eval_jobs(columns, size, prep.seed, prep.partition)
    return PreprocessFeed(jobs, prep, device, threads=threads, prefetch=1, timeout=timeout,
                          name=POOL + "-eval")


def eval_jobs(columns, size: int, seed: int, partition: int):
    """`columns`' rows in chunks of `size`, in order, as `PreprocessFeed` jobs
    (training=False; each chunk's rng fixed by its index)."""
    for k, parts in enumerate(columns.parts(size)):
        yield [parts], False, step_rng(seed, EVAL_STREAM, partition, k)
