"""A partition's rows in the data cache, and the memory cache itself: every field of the
schema as tensors on the task's device. Rows arrive from Spark's shuffle in no fixed order,
but each row's place is known from its global number, so each batch is written straight to
its place (`disk_cache` does the same with files).

A fixed-shape field is one array `[rows, *shape]`. A ragged field is its flat values, appended
as rows arrive, and each row's start and length in them, by place (`ragged`). Floats are held
in the model's dtype (converted once, when the partition is complete), integers at the width
they were carried in (int32 ids stay 4 bytes), booleans as booleans; a minibatch takes the
model's dtypes as it is cut (`typed`): integers int64, ragged fields padded to the batch's
longest row with the field's pad value.
"""

from __future__ import annotations

import math

import numpy as np

from sparkdl_avg.data.ragged import RaggedRows, longest, pad_counts, value_index
from sparkdl_avg.data.schema import Batch, DataSchema

MIB = 1 << 20


def float_dtype_of(schema: DataSchema, dtype=None):
    """The torch dtype float fields take: the model's, else the one they were carried in."""
    import torch

    return dtype if dtype is not None else getattr(torch, schema.float_dtype)


def batch_of(schema: DataSchema, tensors: list, padded: int = 0, positions: int = 0) -> Batch:
    """Tensors in field order as a Batch."""
    n_in, n_labels = len(schema.inputs), len(schema.labels)
    return Batch(tuple(tensors[:n_in]), tuple(tensors[n_in:n_in + n_labels]),
                 tensors[-1] if schema.weight is not None else None, padded, positions)


def tensors_of(batch: Batch) -> list:
    return [*batch.inputs, *batch.labels, *(() if batch.weights is None else (batch.weights,))]


def typed(batch: Batch, schema: DataSchema, float_dtype) -> Batch:
    """The batch in the dtypes the model gets (`FieldSpec.torch_dtype`); a tensor two fields
    share (an input given as the labels too) converted once."""
    done, tensors = {}, []
    for f, t in zip(schema.fields, tensors_of(batch), strict=True):
        key = (id(t), f.torch_dtype(float_dtype))
        if key not in done:
            done[key] = t.to(key[1])
        tensors.append(done[key])
    return batch_of(schema, tensors, batch.padded, batch.positions)


class _RaggedStore:
    """A ragged field's rows as they arrive: values appended (room grown as needed, from the
    dataset's mean a row), starts and lengths by place."""

    def __init__(self, rows: int, mean_values: float, field) -> None:
        room = max(1, math.ceil(rows * mean_values / max(1, math.prod(field.inner))))
        self.values = np.empty((room, *field.inner), field.dtype)
        self.starts = np.zeros(rows, np.int64)
        self.lengths = np.zeros(rows, np.int64)
        self.end = 0

    def write(self, place, rows: RaggedRows) -> None:
        end = self.end + len(rows.values)
        if end > len(self.values):  # grown geometrically: amortised copies
            grown = np.empty((max(end, len(self.values) * 3 // 2), *self.values.shape[1:]),
                             self.values.dtype)
            grown[:self.end] = self.values[:self.end]
            self.values = grown
        self.values[self.end:end] = rows.values
        self.starts[place] = rows.starts + self.end
        self.lengths[place] = rows.lengths
        self.end = end


class _DeviceRagged:
    """A ragged field on the device; its lengths also on the host, so that a batch's longest
    row is known without waiting for the device."""

    def __init__(self, store: _RaggedStore, device, dtype) -> None:
        # the room beyond the last value given back in place: the tensor may share the array
        store.values.resize((store.end, *store.values.shape[1:]), refcheck=False)
        self.values = _to_device(store.values, device, dtype)
        self.starts = _to_device(store.starts, device)
        self.lengths = _to_device(store.lengths, device)
        self.host_lengths = store.lengths

    def padded(self, index, longest: int, pad_value):
        """Rows `index` (a device tensor) as `[rows, longest, *inner]`: a gather and a fill,
        no boolean indexing (which would wait for the device)."""
        import torch

        offsets = torch.arange(longest, device=self.values.device)
        keep = offsets < self.lengths.index_select(0, index)[:, None]
        at = torch.where(keep, self.starts.index_select(0, index)[:, None] + offsets, 0)
        out = self.values.index_select(0, at.view(-1)).view(*at.shape, *self.values.shape[1:])
        return out.masked_fill(~keep.view(*keep.shape, *(1,) * (out.dim() - 2)), pad_value)


class MemoryColumns:
    """Every carried field (`DataSchema.carried`) as tensors on the task's device."""

    in_memory = True

    def __init__(self, schema: DataSchema, columns: list, rows: int, float_dtype,
                 device) -> None:
        self.schema, self.columns, self.rows = schema, columns, rows
        self.float_dtype, self.device = float_dtype, device
        self.assemble_s, self.assembled_bytes = 0.0, 0
        """Time spent, and bytes produced, assembling minibatches (`batches`)."""

    def take(self, rows: np.ndarray, index=None) -> Batch:
        """Rows `rows` (local places, a numpy array) as a Batch on the device; `index`: the
        same places already on the device."""
        import torch

        if index is None:
            index = torch.from_numpy(np.ascontiguousarray(rows, np.int64)).to(self.device)
        tensors, padded, positions, made = [], 0, 0, {}
        for field, slot in zip(self.schema.fields, self.schema.slots(), strict=True):
            column = self.columns[slot]
            # a column bound as an input and a label: one gather for both (a ragged label
            # pads with -100 where its input pads with 0: a gather of its own)
            key = (slot, field.pad_value if field.ragged else None)
            if key in made:
                tensors.append(made[key])
                continue
            if field.ragged:
                lengths = column.host_lengths[rows]
                most = longest(lengths)
                tensor = column.padded(index, most, field.pad_value)
                if field.role == "input":
                    pads, all_ = pad_counts(lengths, most)
                    padded, positions = padded + pads, positions + all_
            else:  # not column[index]: on the CPU, advanced indexing is 100 times slower
                tensor = column.index_select(0, index)
            made[key] = tensor.to(field.torch_dtype(self.float_dtype))
            tensors.append(made[key])
        return batch_of(self.schema, tensors, padded, positions)

    def chunks(self, size: int):
        for start in range(0, self.rows, size):
            yield self.take(np.arange(start, min(start + size, self.rows)))

    def part(self, rows: np.ndarray) -> list:
        """Rows `rows` as they are held (a cache on the host: `fit(preprocess=)`), copied, in
        `disk_cache.Window.part`'s form: per carried field an array, or a ragged field's
        (values, lengths)."""
        out = []
        for field, column in zip(self.schema.carried, self.columns, strict=True):
            if field.ragged:
                lengths = column.host_lengths[rows]
                at = value_index(column.starts.numpy()[rows], lengths)
                out.append((column.values.numpy()[at], lengths))
            else:
                out.append(column.numpy()[rows])
        return out

    def parts(self, size: int):
        """`part`s of `size` rows in order (evaluation under `fit(preprocess=)`)."""
        for start in range(0, self.rows, size):
            yield self.part(np.arange(start, min(start + size, self.rows)))

    def close(self) -> None:
        self.columns = []


class MemoryWriter:
    def __init__(self, schema: DataSchema, rows: int, ragged_values: dict) -> None:
        self.schema, self.rows = schema, rows
        self.stores = [_RaggedStore(rows, ragged_values[f.wire], f) if f.ragged
                       else np.empty((rows, *f.shape), f.dtype) for f in schema.carried]

    def write(self, place: np.ndarray, columns: list) -> None:
        """Rows to places `place` (sorted, unique: one run of places is a slice); `columns`
        in carried order (`DataSchema.carried`), arrays in place order or `RaggedRows`."""
        if place[-1] - place[0] == place.size - 1:
            place = slice(int(place[0]), int(place[-1]) + 1)
        for store, rows in zip(self.stores, columns, strict=True):
            if isinstance(store, _RaggedStore):
                store.write(place, rows)
            else:
                store[place] = rows

    @property
    def bytes(self) -> int:
        return sum(s.nbytes if isinstance(s, np.ndarray) else
                   s.values[:s.end].nbytes + s.starts.nbytes + s.lengths.nbytes
                   for s in self.stores)

    def finish(self, device, dtype=None) -> MemoryColumns:
        """The columns as tensors on `device`, floats in `dtype` (the model's; None: as
        carried): converted here, once, so only that copy stays."""
        float_dtype = float_dtype_of(self.schema, dtype)
        columns = []
        for field, store in zip(self.schema.carried, self.stores, strict=True):
            want = field.torch_dtype(float_dtype) if field.kind == "float" else None
            columns.append(_DeviceRagged(store, device, want) if field.ragged
                           else _to_device(store, device, want))
        self.close()
        return MemoryColumns(self.schema, columns, self.rows, float_dtype, device)

    def close(self) -> None:
        self.stores = []


def _to_device(array: np.ndarray, device, dtype=None):
    import torch

    t = torch.from_numpy(array)
    dtype = dtype or t.dtype
    if device.type == "cuda":  # in slices: no pinned copy of the whole partition
        return _to_cuda(t, device, dtype)
    return t.to(dtype)


def _to_cuda(t, device, dtype, slice_bytes: int = 64 * MIB):
    import torch

    out = torch.empty(t.shape, dtype=dtype, device=device)
    step = max(1, slice_bytes // max(1, t[:1].nbytes))
    for start in range(0, t.shape[0], step):
        out[start:start + step].copy_(t[start:start + step].pin_memory(), non_blocking=True)
    torch.cuda.synchronize(device)
    return out
