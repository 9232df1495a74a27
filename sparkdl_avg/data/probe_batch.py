"""A two-row batch made from a `DataSchema` alone, on the driver: what the model is run on once
before any task starts (the fit's probe check, and scoring's return type).

Every field is zeros of its dtype and row shape, except integer fields, whose first row holds
the given `low` and second row the given `high` (the smallest and largest value seen, so an
Embedding too small for the data fails here), and ragged fields, whose rows have the given
length (2 by default).
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
