"""A two-row batch made from a `DataSchema` alone, on the driver: what the model is run on once
before any task starts (the fit's probe check, and scoring's return type).

Every field is zeros of its dtype and row shape, except integer fields, whose first row holds
the given `low` and second row the given `high` (the smallest and largest value seen, so an
Embedding too small for the data fails here), and ragged fields, whose rows have the given
length (2 by default).

With `fit(preprocess=)` the probe runs on real rows instead (what preprocess returned for a
sample of train_df), and `with_ranges` puts the smallest and largest value in the integer
columns preprocess passes through (`passed_ranges`): a column it returns may hold other values
than the ones validation saw, so its range is not probed.
"""

from __future__ import annotations

from sparkdl_avg.data.schema import Batch, DataSchema, FieldSpec

ROWS = 2
RAGGED_LENGTH = 2


def probe_batch(schema: DataSchema, float_dtype, *, low: dict[str, int] | None = None,
                high: dict[str, int] | None = None,
                lengths: dict[str, int] | None = None) -> Batch:
    """The probe batch of `schema`, tensors in the dtypes the model gets (`float_dtype`: the
    model's). `low`, `high` and `lengths` are keyed by a field's wire name; a field they do
    not name gets 0 (low and high) and `RAGGED_LENGTH`."""
    low, high, lengths = low or {}, high or {}, lengths or {}

    def make(field: FieldSpec):
        return field_rows(field, float_dtype, low=low.get(field.wire, 0),
                          high=high.get(field.wire, 0),
                          length=lengths.get(field.wire, RAGGED_LENGTH))

    return Batch(inputs=tuple(map(make, schema.inputs)), labels=tuple(map(make, schema.labels)),
                 weights=None if schema.weight is None else make(schema.weight))


def field_rows(field: FieldSpec, float_dtype, *, low: int = 0, high: int = 0,
               length: int = RAGGED_LENGTH):
    """Two rows of `field` as one tensor `[2, *shape]` (a ragged field's outer length:
    `length`): zeros, or for an integer field `low` in the first row and `high` in the
    second."""
    import torch

    shape = ((length, *field.inner) if field.ragged else field.shape)
    out = torch.zeros((ROWS, *shape), dtype=field.torch_dtype(float_dtype))
    if field.kind == "int":
        out[0] = low
        out[1] = high
    return out


def passed_ranges(raw: DataSchema, model: DataSchema | None, ranges: dict) -> dict:
    """`ranges` (by wire) of the fields the model gets as they were carried: every field
    without a preprocess (`model` None), else those preprocess does not return."""
    if model is None:
        return ranges
    kept = {f.wire for f in model.fields if f in raw.fields}
    return {wire: r for wire, r in ranges.items() if wire in kept}


def first_rows(batch: Batch, rows: int = ROWS) -> Batch:
    """`batch`'s first `rows` rows, copied: the probe's sample without the rest of the rows
    it was cut from (a view pickles its whole buffer when it is shipped to an executor)."""
    def cut(t):
        return t[:rows].clone()

    return Batch(tuple(map(cut, batch.inputs)), tuple(map(cut, batch.labels)),
                 None if batch.weights is None else cut(batch.weights), batch.padded,
                 batch.positions)


def with_ranges(batch: Batch, schema: DataSchema, *, low: dict[str, int],
                high: dict[str, int]) -> Batch:
    """`batch` (real rows, in the model's dtypes) with each integer field `low` and `high`
    name (by wire) holding `low` in its first row and `high` in its second (every position
    of a ragged row, as `field_rows`); a batch of one row is repeated to two first. The other
    fields and rows are as they were."""
    fields = (*schema.inputs, *schema.labels, *((schema.weight,) if schema.weight else ()))
    tensors = (*batch.inputs, *batch.labels, *(() if batch.weights is None else
                                                (batch.weights,)))
    if not low or not tensors or tensors[0].shape[0] == 0:
        return batch
    out = []
    for field, t in zip(fields, tensors, strict=True):
        if t.shape[0] < ROWS:
            t = t.repeat(ROWS, *(1,) * (t.dim() - 1))
        if field.kind == "int" and field.wire in low:
            t = t.clone()
            t[0], t[1] = low[field.wire], high[field.wire]
        out.append(t)
    n_in, n_labels = len(schema.inputs), len(schema.labels)
    return Batch(tuple(out[:n_in]), tuple(out[n_in:n_in + n_labels]),
                 out[-1] if schema.weight is not None else None, batch.padded,
                 batch.positions)
