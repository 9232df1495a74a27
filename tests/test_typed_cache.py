"""The data caches with typed fields, without Spark: a ragged int32 input, a float [2, 3]
input, a bool input, an int64 label, a ragged int label and a float weight, arriving out of
order and split across Arrow batches as `prepare` sends them, give the minibatches an
independent row-by-row computation gives, from memory and from disk; the disk cache reads a
ragged column in merged runs and keeps a task's memory from growing with its partition."""

import errno
import os

import numpy as np
import pyarrow as pa
import pytest
import torch

from sparkdl_avg._errors import DataCacheError
from sparkdl_avg.data.batches import TrainBatches
from sparkdl_avg.data.columns import EVAL, TRAIN
from sparkdl_avg.data.order import Cut, EpochOrder, batch_positions, make_cut
from sparkdl_avg.data.partition import Shape, load_partition
from sparkdl_avg.data.schema import IGNORE_INDEX, DataSchema, FieldSpec
from sparkdl_avg.data.spill import SpillDir
from sparkdl_avg.task import memory

WORKERS, RANK, N_TRAIN, N_EVAL = 3, 2, 230, 40
CPU = torch.device("cpu")
SCHEMA = DataSchema(
    inputs=(FieldSpec("input", "ids", "tokens", "_x0", "int32", (-1,)),
            FieldSpec("input", "image", "image", "_x1", "float32", (2, 3)),
            FieldSpec("input", "flag", "flag", "_x2", "bool", ())),
    binding="keyword",
    labels=(FieldSpec("label", "label", "label", "_y0", "int64", ()),
            FieldSpec("label", "tags", "tags", "_y1", "int16", (-1,))),
    label_list=True, weight=FieldSpec("weight", "w", "w", "_w", "float32", ()))


def _row(g: int) -> list:
    """Global row g's value of each field, in field order (ragged rows of 0 to 5 values)."""
    return [np.arange((g * 7) % 6, dtype=np.int32) + g * 100,
            (g + np.arange(6, dtype=np.float32).reshape(2, 3) / 8).astype(np.float32),
            g % 3 == 0, g % 5,
            (np.arange((g * 3) % 5) + g % 7).astype(np.int16),
            np.float32(g % 10 / 10 + 0.05)]


def _arrow(values: list, field) -> pa.Array:
    """A column as `prepare` sends it: nested lists for shapes, Spark's widths."""
    if field.ragged:
        offsets = np.r_[0, np.cumsum([len(v) for v in values])].astype(np.int32)
        flat = np.concatenate(values) if values else np.zeros(0, field.dtype)
        return pa.ListArray.from_arrays(pa.array(offsets), pa.array(flat))
    array = pa.array(np.array(values, field.dtype).reshape(len(values), -1).ravel())
    for dim in reversed(field.shape):
        offsets = np.arange(0, len(array) + 1, dim, dtype=np.int32)
        array = pa.ListArray.from_arrays(pa.array(offsets), array)
    return array


def _local(split: int) -> np.ndarray:
    """This worker's rows of a split, as global numbers (in the prepared frame both splits
    are numbered from 0, each on its own)."""
    return np.arange(RANK, N_TRAIN if split == TRAIN else N_EVAL, WORKERS)


def _batches(arrival_seed=3, batch_rows=17, run=1, schema=SCHEMA, rows=_row):
    """This worker's train and eval rows, mixed and shuffled in runs of `run` rows, in Arrow
    batches."""
    rows_ = [(g, s) for s in (TRAIN, EVAL) for g in _local(s)]
    runs = np.random.default_rng(arrival_seed).permutation(-(-len(rows_) // run))
    order = [i for r in runs for i in range(r * run, min((r + 1) * run, len(rows_)))]
    arrived = [rows_[i] for i in order]
    for a in range(0, len(arrived), batch_rows):
        part = arrived[a:a + batch_rows]
        values = [rows(g) for g, _ in part]
        arrays = [_arrow([v[i] for v in values], f) for i, f in enumerate(schema.carried)]
        arrays += [pa.array([g for g, _ in part], pa.int64()),
                   pa.array([s for _, s in part], pa.int8())]
        yield pa.RecordBatch.from_arrays(arrays, names=[*schema.wires, "_row", "_split"])


def _shape(schema=SCHEMA, means=None) -> Shape:
    return Shape(RANK, WORKERS, len(_local(TRAIN)), len(_local(EVAL)), schema,
                 means or {"_x0": 2.5, "_y1": 2.0})


@pytest.fixture
def spill(tmp_path):
    with SpillDir.create(1 << 20, dirs=[str(tmp_path)]) as folder:
        yield folder


def _expected(globals_: np.ndarray, float_dtype=torch.float32) -> list:
    """The rows' tensors computed row by row: ragged ones padded to the longest by hand,
    floats in the model's dtype."""
    out = []
    for i, f in enumerate(SCHEMA.fields):
        values = [_row(int(g))[i] for g in globals_]
        if f.ragged:
            most = max((len(v) for v in values), default=0)
            grid = np.full((len(values), most), f.pad_value, np.int64)
            for r, v in enumerate(values):
                grid[r, :len(v)] = v
            out.append(torch.from_numpy(grid))
        else:
            want = torch.from_numpy(np.array(values).astype(
                {"int": np.int64, "bool": np.bool_, "float": np.float32}[f.kind]))
            out.append(want.to(f.torch_dtype(float_dtype)) if f.kind == "float" else want)
    return out


def _same(batch, globals_: np.ndarray, float_dtype=torch.float32) -> None:
    got = [t.cpu() for t in (*batch.inputs, *batch.labels, batch.weights)]
    for have, want, f in zip(got, _expected(globals_, float_dtype), SCHEMA.fields,
                             strict=True):
        assert have.dtype == want.dtype and torch.equal(have, want), f.wire
    lengths = np.array([len(_row(int(g))[0]) for g in globals_])
    longest = lengths.max(initial=0)
    assert batch.positions == len(globals_) * longest  # the ragged input's alone
    assert batch.padded == batch.positions - lengths.sum()


def _step_rows(step: int, *, batch: int, epoch_rows: int, steps: int, shuffle: bool,
               cut: Cut) -> np.ndarray:
    """The local rows of the minibatch at `step`, from data/order alone."""
    epoch, in_epoch = divmod(step, steps)
    order = EpochOrder(len(_local(TRAIN)), epoch=epoch, worker=RANK, seed=5, shuffle=shuffle,
                       cut=cut)
    return np.concatenate([order.rows(k)[a:b] for k, a, b in order.windows_of(
        *batch_positions(in_epoch, batch, epoch_rows))])


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize(("shuffle", "dtype", "device"), [
    (True, None, "cpu"), (False, None, "cpu"), (True, torch.bfloat16, "cpu"),
    pytest.param(True, torch.bfloat16, "cuda:0", marks=NEEDS_CUDA)])
def test_both_caches_give_the_rows_batches_computed_by_hand(spill, shuffle, dtype, device):
    """76 rows (the short partition), 6 a step, an epoch padded to the longest partition's 77
    positions, windows of 8 rows: the
    batches of 3 epochs from memory and from disk (and again from a restart mid-epoch) are
    the rows' own values, padded per batch with 0 (inputs) and -100 (int labels), in the
    model's dtypes (a bfloat16 model: floats in bfloat16, integers int64), on the device
    (CUDA: from disk through pinned copies on the side stream)."""
    device = torch.device(device)
    caches = {"memory": load_partition(_batches(), _shape(), cache="memory", device=device,
                                       dtype=dtype),
              "disk": load_partition(_batches(), _shape(), cache="disk", spill=spill,
                                     device=device, dtype=dtype)}
    floats = dtype or torch.float32
    cut, steps = Cut(4, 2), 13
    kw = {"cut": cut, "seed": 5, "worker": RANK, "shuffle": shuffle, "batch_size": 6,
          "steps_per_epoch": steps, "total_steps": 3 * steps, "device": device,
          "epoch_rows": 77}
    for data in caches.values():
        assert data.rows == (76, 13)
        batches = TrainBatches(data.train, **kw)
        for start in (0, 17):  # a restart mid-epoch sees what the first run saw
            batches.start(start)
            for step in range(start, 3 * steps):
                batch = batches.next()
                assert batch.inputs[0].device == device
                _same(batch, _step_rows(step, batch=6, epoch_rows=77, steps=steps,
                                                 shuffle=shuffle, cut=cut) * WORKERS + RANK,
                      floats)
        batches.close()
        chunks = list(data.eval.chunks(5))
        assert [c.rows for c in chunks] == [5, 5, 3]
        for k, chunk in enumerate(chunks):
            _same(chunk, _local(EVAL)[5 * k:5 * k + 5], floats)
        data.close()


def test_padding_is_zero_for_inputs_and_ignored_for_int_labels():
    data = load_partition(_batches(), _shape(), cache="memory", device=CPU)
    batch = next(data.train.chunks(76))
    ids, tags = batch.inputs[0], batch.labels[1]
    short = torch.tensor([len(_row(int(g))[0]) < ids.shape[1] for g in _local(TRAIN)])
    assert short.any() and (ids[short, -1] == 0).all()
    assert (tags == IGNORE_INDEX).any() and not (tags[tags < 0] != IGNORE_INDEX).any()
    assert batch.padded > 0


SHARED = DataSchema(  # a causal LM's labels are its input_ids; an autoencoder's, its image
    inputs=(FieldSpec("input", "input_ids", "tokens", "_x0", "int32", (-1,)),
            FieldSpec("input", "image", "image", "_x1", "float32", (2, 3))),
    binding="keyword",
    labels=(FieldSpec("label", "tokens", "tokens", "_x0", "int32", (-1,)),
            FieldSpec("label", "image", "image", "_x1", "float32", (2, 3))),
    label_list=True)


def test_a_column_bound_as_input_and_label_is_cached_once_and_shared(spill):
    """Both caches hold the column once (one store, one set of files), and hand the label
    the input's own tensor (a ragged label the same rows, padded with -100 where the input
    has 0), from training batches, evaluation chunks and the preprocess feed alike."""
    from sparkdl_avg.data.feed import Preprocessor

    def check(batch, globals_):
        (ids, image), (tokens, same) = batch.inputs, batch.labels
        assert same is image and torch.equal(image, _expected(globals_)[1])
        want = _expected(globals_)[0]  # the ragged input padded with 0, by hand
        assert torch.equal(ids, want)
        pads = torch.tensor([[k >= len(_row(int(g))[0]) for k in range(want.shape[1])]
                             for g in globals_], dtype=torch.bool).reshape(want.shape)
        assert torch.equal(tokens, want.masked_fill(pads, IGNORE_INDEX))

    shape = _shape(SHARED, {"_x0": 2.5})
    memory = load_partition(_batches(schema=SHARED), shape, cache="memory", device=CPU)
    disk = load_partition(_batches(schema=SHARED), shape, cache="disk", spill=spill,
                          device=CPU)
    assert len(memory.train.columns) == 2
    assert sorted(n for n in os.listdir(spill.path) if n.startswith("train-")) == [
        "train-_x0-lengths.i8", "train-_x0-starts.i8", "train-_x0-values.i4",
        "train-_x1.f4"]
    everything = _local(TRAIN)
    for data in (memory, disk):
        check(next(data.train.chunks(76)), everything)
        batches = TrainBatches(data.train, cut=Cut(4, 2), seed=5, worker=RANK, shuffle=False,
                               batch_size=76, steps_per_epoch=1, total_steps=1, device=CPU)
        batches.start(0)
        check(batches.next(), everything)
        batches.close()
        prep = Preprocessor(lambda b, **_: {"image": b["image"] * 2}, SHARED, SHARED,
                            torch.float32, seed=0, partition=0)
        passed = Preprocessor(lambda b, **_: {}, SHARED, SHARED, torch.float32, seed=0,
                              partition=0)
        part = data.train.part(np.arange(76)) if data.cache == "memory" else \
            next(data.train.parts(76))
        check(passed([part], training=True, rng=None), everything)
        doubled = prep([part], training=True, rng=None)
        assert doubled.labels[1] is doubled.inputs[1]
        assert torch.equal(doubled.inputs[1], 2 * _expected(everything)[1])
        data.close()


def _value_offsets(field_index: int, arrival_seed: int, batch_rows: int, run: int) -> dict:
    """Where each training row's values start in the values file, from the arrival order
    alone: rows append their values as they come."""
    offsets, end = {}, 0
    for batch in _batches(arrival_seed, batch_rows, run):
        split = batch.column("_split").to_numpy()
        rows = batch.column("_row").to_numpy()
        lengths = batch.column(SCHEMA.fields[field_index].wire).value_lengths().to_numpy()
        for g, s, n in zip(rows, split, lengths, strict=True):
            if s == TRAIN:
                offsets[(int(g) - RANK) // WORKERS] = (end, int(n))
                end += int(n)
    return offsets


@pytest.mark.parametrize(("arrival_seed", "batch_rows"), [(None, 300), (4, 17)])
def test_disk_reads_a_ragged_column_in_runs_of_contiguous_values(spill, monkeypatch,
                                                                  arrival_seed, batch_rows):
    """One read per run of rows whose values lie one after another in the file: rows that
    arrived in order need a read per contiguous range of rows; rows that arrived shuffled in
    runs of 8 (and cut across Arrow batches), one per run of stored values."""
    batches = _batches(arrival_seed, batch_rows, 8) if arrival_seed is not None else \
        _in_order(batch_rows)
    data = load_partition(batches, _shape(), cache="disk", spill=spill, device=CPU)
    columns = data.train
    reads = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: reads.append(fd) or
                        preadv(fd, bufs, offset))
    ranges = [(0, 10), (10, 30), (40, 52), (60, 76)]
    window = columns.empty(58)
    assert columns.read_into(ranges, window) == 58
    layout = np.concatenate([np.arange(a, b) for a, b in ranges])
    for i, fd in columns._values.items():
        if arrival_seed is None:  # in order: the ranges, less the one that follows on
            want = 3
        else:
            offsets, want, end = _value_offsets(i, arrival_seed, batch_rows, 8), 0, None
            for row in layout:
                start, n = offsets[row]
                if n:
                    want += start != end
                    end = start + n
            assert want < np.count_nonzero([offsets[r][1] for r in layout])  # some merged
        assert reads.count(fd) == want, SCHEMA.fields[i].wire
    assert len(reads) > 0
    data.close()


def _in_order(batch_rows: int):
    """The rows in their local order, both splits apart: each values file in place order."""
    for batch in _batches(0, 10_000):
        order = np.lexsort((batch.column("_row").to_numpy(), batch.column("_split").to_numpy()))
        batch = batch.take(pa.array(order))
        for a in range(0, batch.num_rows, batch_rows):
            yield batch.slice(a, batch_rows)


def _no_room(*args):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_refused_naming_the_folder_when_preallocating(spill, monkeypatch):
    monkeypatch.setattr(os, "posix_fallocate", _no_room)
    with pytest.raises(DataCacheError, match=f"no room for the data cache in {spill.path}"):
        load_partition(_batches(), _shape(), cache="disk", spill=spill, device=CPU)


def test_a_values_file_that_outgrows_its_estimate_on_a_full_disk_is_named(spill, monkeypatch):
    """The mean a row sizes the values file; a partition with longer rows appends past it,
    and a disk that fills then is named too."""
    opened, open_, pwrite = {}, os.open, os.pwrite

    def record(path, *args, **kw):
        fd = open_(path, *args, **kw)
        opened[fd] = os.path.basename(path)
        return fd

    def full_past_estimate(fd, data, offset):
        if "-values." in opened.get(fd, "") and offset > 0:
            _no_room()
        return pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", record)
    monkeypatch.setattr(os, "pwrite", full_past_estimate)
    with pytest.raises(DataCacheError, match=f"no room for the data cache in {spill.path}: "
                                             r"writing .* to train-_x0-values\.i4 failed"):
        load_partition(_batches(), _shape(means={"_x0": 0.01, "_y1": 0.01}), cache="disk",
                       spill=spill, device=CPU)


RSS_ROWS, RSS_MEAN = 400_000, 32  # int32 ids: 51 MB of values
RSS_BOUND_MB = 20
"""A disk-cached ragged column's resident growth while loading and reading a whole epoch,
beyond what a partition 20 times smaller left (measured: about 8 MB): an Arrow batch in
flight (1 MB of values) and its copies, the 2 MB shuffle window, the prefetched minibatches
(padded, as int64) and allocator slack; the partition itself is 2.5 times the bound."""
RSS_SCHEMA = DataSchema(
    inputs=(FieldSpec("input", "ids", "ids", "_x0", "int32", (-1,)),), binding="single",
    labels=(FieldSpec("label", "label", "label", "_y0", "int64", ()),), label_list=False)


def _big_ragged(rows: int, batch_rows: int = 8192):
    """Rows of 0 to 64 ids (32 a row on average), generated a batch at a time."""
    for a in range(0, rows, batch_rows):
        n = min(batch_rows, rows - a)
        rng = np.random.default_rng(a)
        lengths = rng.integers(0, 2 * RSS_MEAN + 1, n)
        offsets = np.r_[0, np.cumsum(lengths)].astype(np.int32)
        ids = rng.integers(0, 50_000, offsets[-1], dtype=np.int32)
        yield pa.RecordBatch.from_arrays(
            [pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
             pa.array(np.arange(a, a + n) % 7), pa.array(np.arange(a, a + n)),
             pa.array(np.zeros(n, np.int8))], names=["_x0", "_y0", "_row", "_split"])


def _load_and_read(rows: int, folder_base: str) -> int:
    """Rows of `_big_ragged` loaded to disk and read back over one shuffled epoch (2 MB
    windows); returns the rows read."""
    shape = Shape(0, 1, rows, 0, RSS_SCHEMA, {"_x0": float(RSS_MEAN)})
    steps = -(-rows // 1024)
    with SpillDir.create(shape.bytes, dirs=[folder_base]) as folder:
        data = load_partition(_big_ragged(rows), shape, cache="disk", spill=folder,
                              device=CPU)
        assert data.spilled_bytes >= shape.bytes * 0.9
        batches = TrainBatches(data.train, cut=make_cut(shape.row_bytes, 2), seed=1, worker=0,
                               shuffle=True, batch_size=1024, steps_per_epoch=steps,
                               total_steps=steps, device=CPU)
        batches.start(0)
        read = sum(batches.next().rows for _ in range(steps))
        batches.close()
        data.close()
    return read


def test_a_disk_cached_ragged_column_does_not_grow_a_tasks_memory(tmp_path):
    """A 51 MB ragged int32 column loaded to disk and read back over a whole shuffled epoch
    leaves the process's peak resident memory within RSS_BOUND_MB of where a 2.5 MB one
    left it (the process warmed as a reused Python worker is: Arrow's pool and the
    allocator's arenas are paid for once, whatever the size)."""
    _load_and_read(20_000, str(tmp_path))
    if not memory.reset_peak():
        pytest.skip("the peak resident memory cannot be reset here")
    start = memory.resident_bytes()
    assert _load_and_read(RSS_ROWS, str(tmp_path)) == RSS_ROWS
    growth_mb = (memory.peak_resident_bytes() - start) / 2**20
    assert growth_mb < RSS_BOUND_MB, growth_mb
