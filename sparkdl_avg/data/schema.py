"""One description of a fit's data: every input, label and weight, with the dtype it is carried
in and the shape of a row, derived once on the driver (`data/prepare`) and carried everywhere
else: to the tasks (the cache and the minibatches), to scoring, to the Spark ML model's saved
form and to the MLflow signature. Nothing downstream re-derives a dtype or a shape.

A shape is the shape of one row: () a scalar, (d,) a vector, (1, 8, 8) an image; -1 as its
first dimension marks a ragged field (the outer length varies by row, the inner ones do not),
padded per minibatch to the batch's longest row.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

INT_DTYPES = ("int8", "int16", "int32", "int64", "uint8")
"""uint8 is never carried from Spark (it has no such type): it is what a preprocess returns
for an input (an image's pixels), which the model gets as uint8 (`FieldSpec.torch_dtype`)."""
IGNORE_INDEX = -100
"""The pad of a ragged integer label: the built-in cross-entropy ignores it."""


IMAGE_FIELDS = ("height", "width", "nChannels", "mode")
"""The integers of Spark's `image` source struct that reach `preprocess` (`origin` does not),
carried in this order as a 16-byte big-endian header before the pixels
(`describe.pack_image`)."""

@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One column of the data as the model sees it."""

    role: str
    """"input", "label" or "weight"."""
    name: str
    """An input's forward parameter (keyword binding) or its column; a label's or the
    weight's column."""
    column: str | tuple[str, ...]
    """The user's column; a tuple: numeric columns assembled into one vector."""
    wire: str
    """Its column in the prepared frame and the tasks' Arrow batches."""
    dtype: str
    """The numpy dtype it is carried and cached in: integers keep their width (int32 ids stay
    4 bytes), floats the model's float32 or float64 (a bfloat16 model's floats travel as
    float32; its memory cache converts them once)."""
    shape: tuple[int, ...]
    """A row's shape; -1 first: ragged."""
    source: str = ""
    """The Spark type, for messages."""
    encoded: bool = False
    """A binary column (an image file, an encoded record) or a string one (text to
    tokenize): carried and cached as a ragged uint8 field (a string's UTF-8 bytes), handed to
    `fit(preprocess=)` as `bytes` (or `str`), never to the model itself."""

    @property
    def image(self) -> bool:
        """An encoded field from Spark's `image` source struct (the only struct carried):
        its bytes are a header of ints before the pixels (`describe.pack_image`)."""
        return self.encoded and self.source.startswith("struct<")

    @property
    def text(self) -> bool:
        """An encoded field from a string column: carried as its UTF-8 bytes, handed to
        `fit(preprocess=)` as `str`."""
        return self.encoded and self.source == "string"

    @property
    def ragged(self) -> bool:
        return bool(self.shape) and self.shape[0] == -1

    @property
    def inner(self) -> tuple[int, ...]:
        """The dimensions after the first of a ragged field (fixed)."""
        return self.shape[1:]

    @property
    def kind(self) -> str:
        """"int", "bool", "float", or "bytes" (encoded)."""
        if self.encoded:
            return "bytes"
        return "int" if self.dtype in INT_DTYPES else ("bool" if self.dtype == "bool"
                                                       else "float")

    @property
    def values_per_row(self) -> int | None:
        """Elements in a row (None for a ragged field)."""
        return None if self.ragged else math.prod(self.shape)

    @property
    def pad_value(self) -> int:
        """What pads a ragged row: 0, or -100 for an integer label (ignored by the loss)."""
        return IGNORE_INDEX if self.role == "label" and self.kind == "int" else 0

    @property
    def key(self) -> str:
        """What a scoring input is named by (the MLflow signature, a pandas DataFrame's
        column, a dict's key): its column; for numeric columns assembled, its name."""
        return self.column if isinstance(self.column, str) else self.name

    @property
    def described(self) -> str:
        """How messages name it: its column (or columns) and what it is for."""
        column = self.column if isinstance(self.column, str) else list(self.column)
        what = f"input {self.name!r}" if self.role == "input" and self.name != column else \
            self.role
        return f"column {column!r} ({what})"

    def torch_dtype(self, float_dtype):
        """The dtype the model gets: int64 for integers (what nn.Embedding and the losses
        index with), but uint8 for a uint8 input (only a preprocess returns one: an image's
        pixels, 1 byte each, which the model converts itself: `x.float() / 255`), bool, else
        `float_dtype` (the model's; a weight at least float32)."""
        import torch

        if self.role == "weight":  # never rounded to a half type: w must count as w copies
            return torch.promote_types(float_dtype, torch.float32)
        if self.dtype == "uint8" and not self.encoded:
            return torch.uint8
        return {"int": torch.int64, "bool": torch.bool, "bytes": torch.uint8}.get(
            self.kind, float_dtype)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["shape"] = list(self.shape)
        out["column"] = self.column if isinstance(self.column, str) else list(self.column)
        if not self.encoded:  # the saved forms of fits without binary columns stay as they were
            del out["encoded"]
        return out

    @classmethod
    def from_dict(cls, d: dict) -> FieldSpec:
        column = d["column"] if isinstance(d["column"], str) else tuple(d["column"])
        return cls(role=d["role"], name=d["name"], column=column, wire=d["wire"],
                   dtype=d["dtype"], shape=tuple(d["shape"]), source=d.get("source", ""),
                   encoded=d.get("encoded", False))


@dataclass(frozen=True, slots=True)
class DataSchema:
    """Every field of a fit's data, in the order the prepared frame carries them."""

    inputs: tuple[FieldSpec, ...]
    binding: str
    """How the inputs reach the model: "single" model(x), "positional" model(*xs), or
    "keyword" model(**xs)."""
    labels: tuple[FieldSpec, ...]
    label_list: bool
    """label_col was a list: the model returns a tuple, one output per label."""
    weight: FieldSpec | None = None
    float_dtype: str = "float32"
    """What float columns are carried as: the model's float32, or float64."""
    idents: tuple[FieldSpec, ...] = ()
    """`fit(preprocess=)`: a column naming each row (`path`...), carried and cached as an
    encoded field after the others, never handed to preprocess or the model: a failing
    preprocess names the batch's first row by it."""

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        """Every carried field: inputs, labels, the weight, then the idents."""
        return (*self.inputs, *self.labels, *((self.weight,) if self.weight else ()),
                *self.idents)

    @property
    def data_fields(self) -> tuple[FieldSpec, ...]:
        """The fields preprocess and the model get (all but the idents)."""
        return self.fields[:len(self.fields) - len(self.idents)]

    @property
    def carried(self) -> tuple[FieldSpec, ...]:
        """The fields as carried and cached: one per wire, in field order. A label bound to an
        input's column (a causal LM's labels are its input_ids) shares the input's wire: the
        column travels and is cached once, and a batch gives both roles the same rows."""
        first = {}
        for f in self.fields:
            first.setdefault(f.wire, f)
        return tuple(first.values())

    @property
    def carried_data(self) -> tuple[FieldSpec, ...]:
        """`carried` but the idents (which come last)."""
        carried = self.carried
        return carried[:len(carried) - len(self.idents)]

    def slots(self) -> list[int]:
        """For each of `fields`, the place of its wire in `carried`."""
        place = {f.wire: i for i, f in enumerate(self.carried)}
        return [place[f.wire] for f in self.fields]

    @property
    def wires(self) -> list[str]:
        return [f.wire for f in self.carried]

    @property
    def input_names(self) -> list[str]:
        return [f.name for f in self.inputs]

    @property
    def ragged(self) -> bool:
        return any(f.ragged for f in self.fields)

    @property
    def num_features(self) -> int | None:
        """The width of a single fixed vector input (what a fit of one vector reports, as
        before typed inputs); None for any other inputs."""
        x = self.inputs[0]
        return x.shape[0] if len(self.inputs) == 1 and len(x.shape) == 1 and not x.ragged \
            else None

    def call(self, model, inputs, labels=None):
        """The model's output on a batch's input tensors, bound as the fit said: every
        consumer (training, evaluation, the probe, scoring, the MLflow model) calls it here.
        A Hugging Face `ModelOutput` comes back as its logits (`_model_output.logits_of`);
        with `labels` (`loss="model"`) they go to forward as `labels=`, and the output comes
        back whole, its `.loss` the loss."""
        from sparkdl_avg._model_output import LABELS_PARAMETER, logits_of

        extra = {} if labels is None else {LABELS_PARAMETER: labels}
        if self.binding == "keyword":
            out = model(**{f.name: x for f, x in zip(self.inputs, inputs, strict=True)},
                        **extra)
        else:
            out = model(*inputs, **extra)
        return out if labels is not None else logits_of(out)

    def row_bytes(self, ragged_values: dict[str, float] | None = None) -> int:
        """Bytes a row takes as carried: a ragged field its values per row on average
        (`ragged_values`, by wire; 1 if unknown) and its start and length (8 bytes each)."""
        import numpy as np

        total = 0.0
        for f in self.carried:
            size = np.dtype(f.dtype).itemsize
            if f.ragged:
                total += 16 + (ragged_values or {}).get(f.wire, 1.0) * size
            else:
                total += f.values_per_row * size
        return max(1, math.ceil(total))

    def padded_row_bytes(self, longest: dict[str, int]) -> int:
        """Bytes a row takes padded to the longest row of each ragged field (`longest`, by
        wire): what sizes a chunk of rows to evaluate or score, whose rows pad to their
        longest, so a long tail of lengths cannot take a chunk past its budget."""
        return self.row_bytes({f.wire: longest.get(f.wire, 1) * math.prod(f.inner)
                               for f in self.fields if f.ragged})

    def to_dict(self) -> dict:
        return {"inputs": [f.to_dict() for f in self.inputs], "binding": self.binding,
                "labels": [f.to_dict() for f in self.labels], "label_list": self.label_list,
                "weight": self.weight.to_dict() if self.weight else None,
                "float_dtype": self.float_dtype,
                **({"idents": [f.to_dict() for f in self.idents]} if self.idents else {})}

    @classmethod
    def from_dict(cls, d: dict) -> DataSchema:
        return cls(inputs=tuple(FieldSpec.from_dict(f) for f in d["inputs"]),
                   binding=d["binding"],
                   labels=tuple(FieldSpec.from_dict(f) for f in d["labels"]),
                   label_list=d["label_list"],
                   weight=FieldSpec.from_dict(d["weight"]) if d.get("weight") else None,
                   float_dtype=d.get("float_dtype", "float32"),
                   idents=tuple(FieldSpec.from_dict(f) for f in d.get("idents", ())))

    def without_targets(self, idents: bool = False) -> DataSchema:
        """The inputs alone: what scoring reads (with `idents`: and the idents after them,
        which a failing preprocess names its row by)."""
        return DataSchema(inputs=self.inputs, binding=self.binding, labels=(),
                          label_list=self.label_list, weight=None,
                          float_dtype=self.float_dtype, idents=self.idents if idents else ())


@dataclass(slots=True)
class Batch:
    """A minibatch: tensors in field order, in the dtypes the model gets, ragged ones padded
    to the batch's longest row."""

    inputs: tuple
    labels: tuple
    weights: object = None
    padded: int = 0
    """Pad positions added to the ragged inputs (for `pad_fraction`)."""
    positions: int = 0
    """All positions of the ragged inputs, pads included."""

    @property
    def rows(self) -> int:
        return int(self.inputs[0].shape[0])

    @property
    def nbytes(self) -> int:
        tensors = (*self.inputs, *self.labels, *((self.weights,) if self.weights is not None
                                                 else ()))
        return sum({id(t): t.nbytes for t in tensors}.values())  # a shared tensor once

    def map(self, fn) -> Batch:
        """`fn` of each tensor, once per tensor: an input given as the labels too stays one
        tensor (moved or converted once)."""
        done = {}

        def once(t):
            if id(t) not in done:
                done[id(t)] = fn(t)
            return done[id(t)]

        return Batch(tuple(map(once, self.inputs)), tuple(map(once, self.labels)),
                     None if self.weights is None else once(self.weights), self.padded,
                     self.positions)

    def to(self, device, non_blocking: bool = False) -> Batch:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def record_stream(self, stream) -> None:
        for t in (*self.inputs, *self.labels, *((self.weights,) if self.weights is not None
                                                else ())):
            t.record_stream(stream)
