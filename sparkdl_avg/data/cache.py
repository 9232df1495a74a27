"""A partition's rows, held in memory (tensors on the task's device) or on local disk (one raw
little-endian file per column, rows in their local order, read back through file handles).

Rows arrive from Spark's shuffle in no fixed order, but each row's place is known from its
global number, so each batch is written straight to its place: in memory by index, on disk by
positional writes of its contiguous runs. Fixed-width rows at computed offsets are what let
the disk cache be sorted as it arrives; a columnar file format with variable layout (Arrow
IPC) would need a second, sorting pass. The files are `np.memmap`-able for inspection, but the
cache itself never maps them: mapped pages would count toward the task's resident memory.
"""

from __future__ import annotations

import contextlib
import errno
import os

import numpy as np

from sparkdl_avg._errors import DataCacheError

MIB = 1 << 20


class MemoryColumns:
    """Features and labels as tensors on the task's device."""

    in_memory = True

    def __init__(self, x, y) -> None:
        self.x, self.y = x, y
        self.rows = int(x.shape[0])
        self.assemble_s, self.assembled_bytes = 0.0, 0
        """Time spent, and bytes produced, assembling minibatches (`batches`)."""

    def take(self, index):
        return self.x[index], self.y[index]

    def chunks(self, size: int):
        for start in range(0, self.rows, size):
            yield self.x[start:start + size], self.y[start:start + size]

    def close(self) -> None:
        pass


class MemoryWriter:
    def __init__(self, rows: int, num_features: int, x_dtype, y_dtype) -> None:
        self.x = np.empty((rows, num_features), x_dtype)
        self.y = np.empty(rows, y_dtype)

    def write(self, index: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """`index` sorted and unique: one run of places is a slice."""
        if index[-1] - index[0] == index.size - 1:
            index = slice(int(index[0]), int(index[-1]) + 1)
        self.x[index] = x
        self.y[index] = y

    def finish(self, device, dtype=None) -> MemoryColumns:
        """The columns as tensors on `device`, features (and fractional labels) in `dtype`
        (the model's): converted here, once, so only that copy stays."""
        import torch

        x, y = torch.from_numpy(self.x), torch.from_numpy(self.y)
        self.close()
        y_dtype = dtype if dtype is not None and y.is_floating_point() else y.dtype
        x_dtype = dtype or x.dtype
        if device.type == "cuda":  # in slices: no pinned copy of the whole partition
            return MemoryColumns(_to_cuda(x, device, x_dtype), _to_cuda(y, device, y_dtype))
        return MemoryColumns(x.to(x_dtype), y.to(y_dtype))

    def close(self) -> None:
        self.x = self.y = None


def _to_cuda(t, device, dtype, slice_bytes: int = 64 * MIB):
    import torch

    out = torch.empty(t.shape, dtype=dtype, device=device)
    step = max(1, slice_bytes // max(1, t[:1].nbytes))
    for start in range(0, t.shape[0], step):
        out[start:start + step].copy_(t[start:start + step].pin_memory(), non_blocking=True)
    torch.cuda.synchronize(device)
    return out


class DiskColumns:
    """Features and labels in two files; reads go through file handles (`os.preadv`)."""

    in_memory = False

    def __init__(self, paths: tuple[str, str], rows: int, num_features: int, x_dtype,
                 y_dtype) -> None:
        self.paths, self.rows = paths, rows
        self.x_dtype, self.y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
        self.num_features = num_features
        self.row_bytes = (num_features * self.x_dtype.itemsize, self.y_dtype.itemsize)
        self._fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.assemble_s, self.assembled_bytes = 0.0, 0

    def empty(self, rows: int) -> tuple[np.ndarray, np.ndarray]:
        return (np.empty((rows, self.num_features), self.x_dtype),
                np.empty(rows, self.y_dtype))

    def read_into(self, ranges: list[tuple[int, int]], x: np.ndarray, y: np.ndarray) -> int:
        """Rows of `ranges` one after another into the front of x and y; returns the rows."""
        at = 0
        for start, stop in ranges:
            for fd, out, width in zip(self._fds, (x, y), self.row_bytes, strict=True):
                _pread_exactly(fd, out[at:at + stop - start], start * width)
            at += stop - start
        return at

    @property
    def closed(self) -> bool:
        return not self._fds

    def chunks(self, size: int):
        import torch

        x, y = self.empty(min(size, self.rows))
        for start in range(0, self.rows, size):
            n = self.read_into([(start, min(start + size, self.rows))], x, y)
            yield torch.from_numpy(x[:n]), torch.from_numpy(y[:n])

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


def _pread_exactly(fd: int, out: np.ndarray, offset: int) -> None:
    view = memoryview(out).cast("B")
    while len(view):
        got = os.preadv(fd, [view], offset)
        if got == 0:
            raise DataCacheError(f"the data cache file ended early at byte {offset}")
        view, offset = view[got:], offset + got


class DiskWriter:
    """Writes rows to their places in the column files, which are allocated in full up front,
    so a disk without room fails here (naming it) rather than midway."""

    def __init__(self, folder, name: str, rows: int, num_features: int, x_dtype,
                 y_dtype) -> None:
        self.rows, self.num_features = rows, num_features
        self.x_dtype, self.y_dtype = np.dtype(x_dtype), np.dtype(y_dtype)
        self.paths = (folder.file(f"{name}-features.{self.x_dtype.str[1:]}"),
                      folder.file(f"{name}-labels.{self.y_dtype.str[1:]}"))
        self.widths = (num_features * self.x_dtype.itemsize, self.y_dtype.itemsize)
        self._fds = []
        try:
            for path, width in zip(self.paths, self.widths, strict=True):
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                self._fds.append(fd)
                if rows:
                    with _room(path, rows * width):
                        os.posix_fallocate(fd, 0, rows * width)
        except BaseException:  # an open descriptor would keep the space allocated
            self.close()
            raise
        self.bytes = rows * sum(self.widths)

    def write(self, index: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
        """`index` sorted: each run of consecutive places is one write per column."""
        cuts = np.flatnonzero(np.diff(index) != 1) + 1
        for a, b in zip(np.r_[0, cuts], np.r_[cuts, index.size], strict=True):
            place = int(index[a])
            for fd, path, column, width in zip(self._fds, self.paths, (x, y), self.widths,
                                               strict=True):
                data = memoryview(np.ascontiguousarray(column[a:b])).cast("B")
                with _room(path, data.nbytes):
                    _pwrite_all(fd, data, place * width)

    def finish(self, device=None, dtype=None) -> DiskColumns:
        """The columns as files (minibatches take the model's dtype as they are read)."""
        self.close()
        return DiskColumns(self.paths, self.rows, self.num_features, self.x_dtype,
                           self.y_dtype)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []


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
