"""The disk cache: a partition's rows in raw little-endian files in a `spill` folder, read back
through file handles, a shuffle window at a time, so a task's memory never holds its partition.

A fixed-shape field is one file of fixed-width rows in their local order; each batch goes to
its place by positional writes of its contiguous runs. A ragged field is three files: each
row's start and length in its values (fixed-width rows, written by place like any other
column) and the values, appended as rows arrive (`ragged`). Fixed-width rows at computed
offsets are what let the cache be sorted as it arrives; a columnar file format with variable
layout (Arrow IPC) would need a second, sorting pass. The files are `np.memmap`-able for
inspection, but the cache itself never maps them: mapped pages would count toward the task's
resident memory.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os

import numpy as np

from sparkdl_avg._errors import DataCacheError
from sparkdl_avg.data.arrow_columns import starts_of
from sparkdl_avg.data.cache import MIB, batch_of, float_dtype_of, typed
from sparkdl_avg.data.ragged import longest, pad_counts, runs, value_index
from sparkdl_avg.data.schema import Batch, DataSchema


def _row_files(name: str, schema: DataSchema) -> list[tuple[str, np.dtype, tuple]]:
    """(file name, dtype, row shape) of each fixed-width file, in carried order (a column
    bound as an input and a label: once): one a fixed field, two (starts, lengths) a ragged
    one."""
    out = []
    for f in schema.carried:
        if f.ragged:
            out += [(f"{name}-{f.wire}-{part}.i8", np.dtype(np.int64), ())
                    for part in ("starts", "lengths")]
        else:
            out.append((f"{name}-{f.wire}.{np.dtype(f.dtype).str[1:]}", np.dtype(f.dtype),
                        f.shape))
    return out


def _values_file(name: str, field) -> str:
    return f"{name}-{field.wire}-values.{np.dtype(field.dtype).str[1:]}"


class Window:
    """A reused buffer for up to `rows` rows read from the files (a shuffle window, or a
    chunk), in the order they were read; a ragged field's values packed row after row."""

    def __init__(self, columns: DiskColumns, rows: int) -> None:
        self.columns = columns
        self.arrays = [np.empty((rows, *shape), dtype) for _, dtype, shape in columns.files]
        self.values = {i: np.empty((0, *f.inner), f.dtype)
                       for i, f in enumerate(columns.schema.carried) if f.ragged}
        self.starts = {i: np.zeros(rows, np.int64) for i in self.values}
        """Where each row's values start in `values` (a ragged field's)."""

    def part(self, visit: np.ndarray) -> list:
        """The rows at `visit` (positions in the window), copied: per carried field an array,
        or a ragged field's (flat values, lengths)."""
        out = []
        for i, (field, at) in enumerate(zip(self.columns.schema.carried, self.columns.at,
                                            strict=True)):
            if field.ragged:
                lengths = self.arrays[at + 1][visit]
                out.append((self.values[i][value_index(self.starts[i][visit], lengths)],
                            lengths))
            else:
                out.append(self.arrays[at][visit])
        return out


class DiskColumns:
    """Every field in files; reads go through file handles (`os.preadv`)."""

    in_memory = False

    def __init__(self, name: str, folder, schema: DataSchema, rows: int, device=None,
                 float_dtype=None) -> None:
        self.schema, self.rows, self.device = schema, rows, device
        self.float_dtype = float_dtype_of(schema, float_dtype)
        self.files = _row_files(name, schema)
        self.at = _field_files(schema)
        self._fds, self._values = [], {}
        try:  # a file that cannot be opened closes those that were
            for f, _, _ in self.files:
                self._fds.append(os.open(folder.file(f), os.O_RDONLY))
            for i, f in enumerate(schema.carried):
                if f.ragged:
                    self._values[i] = os.open(folder.file(_values_file(name, f)), os.O_RDONLY)
        except BaseException:
            self.close()
            raise
        self.assemble_s, self.assembled_bytes = 0.0, 0
        """Time spent, and bytes produced, assembling minibatches (`batches`)."""

    def empty(self, rows: int) -> Window:
        return Window(self, rows)

    def read_into(self, ranges: list[tuple[int, int]], window: Window) -> int:
        """Rows of `ranges` one after another into the front of `window`; returns the rows.
        One read per range and fixed-width file, then one per run of rows whose values
        follow one another in a values file."""
        at = 0
        for start, stop in ranges:
            for fd, out, (_, dtype, shape) in zip(self._fds, window.arrays, self.files,
                                                  strict=True):
                width = math.prod(shape) * dtype.itemsize
                _pread_exactly(fd, out[at:at + stop - start], start * width)
            at += stop - start
        for i, fd in self._values.items():
            starts, lengths = (window.arrays[self.at[i] + k][:at] for k in (0, 1))
            window.starts[i] = starts_of(lengths)
            values = window.values[i]
            if int(lengths.sum()) > len(values):  # the largest window yet, never the partition
                values = window.values[i] = np.empty((int(lengths.sum()), *values.shape[1:]),
                                                     values.dtype)
            width = _value_bytes(self.schema.carried[i])
            for first, count, to in zip(*runs(starts, lengths), strict=True):
                _pread_exactly(fd, values[to:to + count], int(first) * width)
        return at

    @property
    def closed(self) -> bool:
        return not self._fds

    def chunks(self, size: int):
        """Batches of `size` rows in order, on the device, in the model's dtypes."""
        window = self.empty(min(size, self.rows))
        for start in range(0, self.rows, size):
            n = self.read_into([(start, min(start + size, self.rows))], window)
            batch = assemble(self.schema, [window.part(np.arange(n))])
            if self.device is not None:
                batch = batch.to(self.device)
            yield typed(batch, self.schema, self.float_dtype)

    def parts(self, size: int):
        """`Window.part`s of `size` rows in order, as stored (`fit(preprocess=)`)."""
        window = self.empty(min(size, self.rows))
        for start in range(0, self.rows, size):
            n = self.read_into([(start, min(start + size, self.rows))], window)
            yield window.part(np.arange(n))

    def close(self) -> None:
        for fd in (*self._fds, *self._values.values()):
            os.close(fd)
        self._fds, self._values = [], {}


def _field_files(schema: DataSchema) -> list[int]:
    """Each carried field's first fixed-width file (a ragged field's starts; its lengths
    follow)."""
    out, at = [], 0
    for f in schema.carried:
        out.append(at)
        at += 2 if f.ragged else 1
    return out


def assemble(schema: DataSchema, parts: list[list]) -> Batch:
    """Rows from one or more `Window.part`s (one after another) as a Batch of CPU tensors
    in the dtypes carried, ragged fields padded to the longest row with their pad value; a
    column bound as an input and a label one tensor for both (or, ragged, padded for each)."""
    import torch

    from sparkdl_avg.data.arrow_columns import pad

    tensors, padded, positions, made = [], 0, 0, {}
    for field, i in zip(schema.fields, schema.slots(), strict=True):
        key = (i, field.pad_value if field.ragged else None)
        if key in made:
            tensors.append(made[key])
            continue
        pieces = [p[i] for p in parts]
        if field.ragged:
            values, lengths = (np.concatenate(c) if len(c) > 1 else c[0]
                               for c in zip(*pieces, strict=True))
            most = longest(lengths)
            tensors.append(pad(torch.from_numpy(values), torch.from_numpy(lengths),
                               field.pad_value, most))
            if field.role == "input":
                pads, all_ = pad_counts(lengths, most)
                padded, positions = padded + pads, positions + all_
        else:
            tensors.append(torch.from_numpy(np.concatenate(pieces) if len(pieces) > 1
                                            else pieces[0]))
        made[key] = tensors[-1]
    return batch_of(schema, tensors, padded, positions)


def _pread_exactly(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise DataCacheError(f"the data cache file ended early at byte {offset}")
        view, offset = view[got:], offset + got


class DiskWriter:
    """Writes rows to their places in the fixed-width files, which are allocated in full up
    front (a ragged field's values file at the dataset's mean a row), so a disk without room
    fails here (naming it) rather than midway, as a values file that outgrows its estimate
    still can."""

    def __init__(self, folder, name: str, schema: DataSchema, rows: int,
                 ragged_values: dict) -> None:
        self.folder, self.name, self.schema, self.rows = folder, name, schema, rows
        self.files = _row_files(name, schema)
        self._fds, self._values, self._ends = [], {}, {}
        try:
            for file, dtype, shape in self.files:
                self._fds.append(self._create(file, rows * math.prod(shape) * dtype.itemsize))
            for i, f in enumerate(schema.carried):
                if f.ragged:
                    self._ends[i] = 0
                    self._values[i] = self._create(_values_file(name, f), math.ceil(
                        rows * ragged_values[f.wire]) * np.dtype(f.dtype).itemsize)
        except BaseException:  # an open descriptor would keep the space allocated
            self.close()
            raise

    def _create(self, file: str, nbytes: int) -> int:
        path = self.folder.file(file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        if nbytes:
            try:
                with _room(path, nbytes):
                    os.posix_fallocate(fd, 0, nbytes)
            except BaseException:
                os.close(fd)
                raise
        return fd

    @property
    def bytes(self) -> int:
        fixed = sum(self.rows * math.prod(s) * d.itemsize for _, d, s in self.files)
        return fixed + sum(self._ends[i] * np.dtype(f.dtype).itemsize
                           * math.prod(f.inner) for i, f in enumerate(self.schema.carried)
                           if f.ragged)

    def write(self, place: np.ndarray, columns: list) -> None:
        """Rows to places `place` (sorted): each run of consecutive places is one write per
        fixed-width file; a ragged field's values are one write at its file's end."""
        arrays = []
        for i, (field, rows) in enumerate(zip(self.schema.carried, columns, strict=True)):
            if field.ragged:
                end = self._ends[i]
                _write(self._values[i], self.folder.file(_values_file(self.name, field)),
                       rows.values, end * _value_bytes(field))
                self._ends[i] = end + len(rows.values)
                arrays += [rows.starts + end, rows.lengths]
            else:
                arrays.append(rows)
        cuts = np.flatnonzero(np.diff(place) != 1) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, place.size], strict=True):
            for fd, array, (file, dtype, shape) in zip(self._fds, arrays, self.files,
                                                       strict=True):
                _write(fd, self.folder.file(file), array[a:b],
                       int(place[a]) * math.prod(shape) * dtype.itemsize)

    def finish(self, device=None, dtype=None) -> DiskColumns:
        """The columns as files (minibatches take the model's dtypes as they are read)."""
        self.close()
        return DiskColumns(self.name, self.folder, self.schema, self.rows, device, dtype)

    def close(self) -> None:
        for fd in (*self._fds, *self._values.values()):
            os.close(fd)
        self._fds, self._values = [], {}


def _write(fd: int, path: str, array: np.ndarray, offset: int) -> None:
    data = memoryview(np.ascontiguousarray(array)).cast("B")
    with _room(path, data.nbytes):
        _pwrite_all(fd, data, offset)


def _value_bytes(field) -> int:
    return np.dtype(field.dtype).itemsize * math.prod(field.inner)


@contextlib.contextmanager
def _room(path: str, nbytes: int):
    """A full disk (or quota, or file size limit) as a DataCacheError naming the folder."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DataCacheError(
                f"no room for the data cache in {os.path.dirname(path)}: writing "
                f"{nbytes / MIB:.1f} MiB to {os.path.basename(path)} failed ({exc.strerror}); "
                "free space there, point spark.local.dir elsewhere, or raise "
                "cache_budget_mb") from exc
        raise


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        done = os.pwrite(fd, data, offset)
        data, offset = data[done:], offset + done
