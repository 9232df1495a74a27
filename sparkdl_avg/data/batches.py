"""A worker's minibatches from any step on, in the one order of `order.EpochOrder`, from
either cache.

A minibatch is a `schema.Batch` on the device in the model's dtypes, ragged fields padded to
its longest row. From memory, it is an index into the tensors already on the device. From
disk, a background thread reads each shuffle window (its chunks, one contiguous read each per
file, and a ragged field's values one read per run of rows stored one after another) into one
reused `disk_cache.Window` and assembles the next `PREFETCH` minibatches from it; on CUDA they
are pinned, copied on a side stream one step ahead and take the model's dtypes there.
With `fit(preprocess=)` the cache is on the host, and `feed.PreprocessFeed` gathers the
raw rows of either cache in the same order and preprocesses them on a pool of threads.
Either way the batch at a step is a pure function of the step, so a restart at any step
sees what the uninterrupted run saw, padding included (an epoch of `epoch_rows` positions,
more than a short partition's rows).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time

import numpy as np

from sparkdl_avg.data.cache import typed
from sparkdl_avg.data.disk_cache import assemble
from sparkdl_avg.data.feed import PreprocessFeed, next_from, step_rng
from sparkdl_avg.data.order import Cut, EpochOrder, batch_positions

PREFETCH = 4
"""Minibatches assembled ahead of training (disk cache)."""


class TrainBatches:
    def __init__(self, columns, *, cut: Cut, seed: int, worker: int, shuffle: bool,
                 batch_size: int, steps_per_epoch: int, total_steps: int, device,
                 epoch_rows: int | None = None, preprocess=None, threads: int = 2,
                 prefetch: int = PREFETCH, preprocess_timeout: float = 600.0) -> None:
        self.columns, self.cut, self.device = columns, cut, device
        self.seed, self.preprocess = seed, preprocess
        """`preprocess`: a `feed.Preprocessor`, run on `threads` threads `prefetch` batches
        ahead, each call at most `preprocess_timeout` seconds; None: the cache's batches as
        they are."""
        self.feed_args = {"threads": threads, "prefetch": prefetch,
                          "timeout": preprocess_timeout}
        """`feed.PreprocessFeed`'s settings (evaluation's feed takes its threads and timeout,
        prefetching one chunk: `feed.eval_feed`)."""
        self._feed: PreprocessFeed | None = None
        self.epoch_rows = columns.rows if epoch_rows is None else epoch_rows
        self._order_args = {"worker": worker, "seed": seed, "shuffle": shuffle, "cut": cut}
        self.batch_size, self.steps_per_epoch = batch_size, steps_per_epoch
        self.total_steps = total_steps
        self._producer: _Producer | None = None
        self._copy_stream = None
        self._ahead = None
        self._order: EpochOrder | None = None
        self._order_epoch = -1
        self._window: tuple[int, int, object] | None = None  # (epoch, window, its rows)
        self.step = 0
        self.wait_s = 0.0
        """Seconds the training thread spent in `next`: waiting for a minibatch (prefetched
        from disk, or preprocessed), or assembling it itself (from memory)."""

    def start(self, step: int) -> None:
        """Take up the data at `step`."""
        self.close()
        self.step = step
        if self.preprocess is not None:
            jobs = train_jobs(self, step, self.preprocess.partition)
            self._feed = PreprocessFeed(jobs, self.preprocess, self.device,
                                        **self.feed_args).start()
        elif not self.columns.in_memory:
            self._producer = _Producer(self, step).start()

    def next(self):
        """The minibatch at the current step (a `schema.Batch`), on the device."""
        t0 = time.perf_counter()
        if self._feed is not None:
            out = self._feed.get()
            if out is None:  # the feed's end: a step beyond `total_steps` has no batch
                raise RuntimeError(f"no minibatch at step {self.step}: the fit has "
                                   f"{self.total_steps} steps")
        elif self.columns.in_memory:
            out = self._take(self.step)
        elif self.device.type == "cuda":
            out = self._next_cuda()
        else:
            out = self._producer.get()
        self.step += 1
        self.wait_s += time.perf_counter() - t0
        return out

    def _next_cuda(self):
        import torch

        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        if self._ahead is None:
            self._ahead = self._copy(self._producer.get())
        batch, event = self._ahead
        self._ahead = self._copy(self._producer.get()) \
            if self.step + 1 < self.total_steps else None
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        batch.record_stream(stream)
        return batch

    def _copy(self, batch):
        """The pinned batch to the device and into the model's dtypes, on the side stream."""
        import torch

        cols = self.columns
        with torch.cuda.stream(self._copy_stream):
            out = typed(batch.to(self.device, non_blocking=True), cols.schema,
                        cols.float_dtype)
            return out, self._copy_stream.record_event()

    def order(self, epoch: int) -> EpochOrder:
        if self._order is None or self._order_epoch != epoch:
            self._order = EpochOrder(self.columns.rows, epoch=epoch, **self._order_args)
            self._order_epoch = epoch
        return self._order

    def pieces(self, step: int) -> tuple[int, EpochOrder, list[tuple[int, int, int]]]:
        """The minibatch at `step` as (epoch, its order, [(window, from, to)...])."""
        epoch, in_epoch = divmod(step, self.steps_per_epoch)
        order = self.order(epoch)
        positions = batch_positions(in_epoch, self.batch_size, self.epoch_rows)
        return epoch, order, order.windows_of(*positions)

    def _take(self, step: int):
        """From memory: index the device tensors with the batch's rows."""
        import torch

        t0 = time.perf_counter()
        epoch, order, pieces = self.pieces(step)
        rows, index = [], []
        for k, a, b in pieces:
            if self._window is None or self._window[:2] != (epoch, k):
                host = order.rows(k)
                self._window = (epoch, k, host, torch.from_numpy(host).to(self.device))
            rows.append(self._window[2][a:b])
            index.append(self._window[3][a:b])
        if len(pieces) == 1:
            out = self.columns.take(rows[0], index[0])
        elif pieces:
            out = self.columns.take(np.concatenate(rows), torch.cat(index))
        else:
            out = self.columns.take(np.zeros(0, np.int64))
        if self.device.type != "cuda":  # on CUDA this times only the launch: not counted
            self.columns.assemble_s += time.perf_counter() - t0
            self.columns.assembled_bytes += out.nbytes
        return out

    def close(self) -> None:
        if self._feed is not None:
            self._feed.stop()
            self._feed = None
        if self._producer is not None:
            self._producer.stop()
            self._producer = None
        self._ahead = None


class _Producer:
    """The disk cache's prefetch thread: batches from `step` on into a bounded queue."""

    def __init__(self, batches: TrainBatches, step: int) -> None:
        self.batches = batches
        self.queue: queue.Queue = queue.Queue(PREFETCH)
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(step,), daemon=True,
                                       name="sparkdl-avg-prefetch")

    def start(self) -> _Producer:
        self.thread.start()
        return self

    def get(self):
        return next_from(self, "the data prefetch thread")

    def stop(self) -> None:
        self.stopped.set()
        while self.thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self.queue.get(timeout=0.05)
        self.thread.join()

    def _run(self, step: int) -> None:
        b = self.batches
        cols = b.columns
        window = cols.empty(min(b.cut.window_rows, cols.rows))
        loaded = None
        pin = b.device.type == "cuda"
        try:
            while step < b.total_steps and not self.stopped.is_set():
                t0 = time.perf_counter()
                epoch, order, pieces = b.pieces(step)
                parts = []
                for k, a, c in pieces:
                    if loaded != (epoch, k):
                        cols.read_into(order.ranges(k), window)
                        loaded, window_visit = (epoch, k), order.visit(k)
                    parts.append(window.part(window_visit[a:c]))
                batch = assemble(cols.schema, parts or [window.part(np.zeros(0, np.int64))])
                if pin:  # the side stream copies it and converts it on the device
                    batch = batch.map(lambda t: t.pin_memory())
                else:
                    batch = typed(batch, cols.schema, cols.float_dtype)
                cols.assemble_s += time.perf_counter() - t0
                cols.assembled_bytes += batch.nbytes
                while not self.stopped.is_set() and not cols.closed:
                    try:
                        self.queue.put(batch, timeout=0.05)
                        break
                    except queue.Full:
                        pass
                step += 1
        except BaseException as exc:  # handed to the training thread by get()
            self.error = exc


def train_jobs(batches, step: int, partition: int):
    """The training steps from `step` on, as `PreprocessFeed` jobs: each step's raw rows
    gathered in `batches.pieces` order from either cache (memory: indexed; disk: one shuffle
    window read at a time), the time and bytes counted in the cache's `assemble_s` and
    `assembled_bytes` (the task's `read_mb_s`)."""
    b = batches
    cols = b.columns
    window = None if cols.in_memory else cols.empty(min(b.cut.window_rows, cols.rows))
    loaded = visit = None
    while step < b.total_steps:
        t0 = time.perf_counter()
        epoch, order, pieces = b.pieces(step)
        parts = []
        for k, a, c in pieces:
            if loaded != (epoch, k):  # a window's order once, not once a step
                if cols.in_memory:
                    visit = order.rows(k)
                else:  # one shuffle window read at a time
                    cols.read_into(order.ranges(k), window)
                    visit = order.visit(k)
                loaded = (epoch, k)
            parts.append(cols.part(visit[a:c]) if cols.in_memory else window.part(visit[a:c]))
        if not parts:
            parts = [cols.part(np.zeros(0, np.int64)) if cols.in_memory
                     else window.part(np.zeros(0, np.int64))]
        cols.assemble_s += time.perf_counter() - t0
        cols.assembled_bytes += _raw_bytes(parts)
        yield parts, True, step_rng(b.seed, epoch, partition, step % b.steps_per_epoch)
        step += 1


def _raw_bytes(parts: list[list]) -> int:
    return sum(sum(a.nbytes for a in value) if isinstance(value, tuple) else value.nbytes
               for part in parts for value in part)
