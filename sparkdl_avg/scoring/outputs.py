"""What a model's outputs become when scored: each output's head (how its loss reads it), what
is written for it (`OutputSpec`, decided on the driver from one run on the probe batch), and
the conversion of an output tensor to an Arrow column without a loop over rows.

A head is "class" (cross_entropy: logits, class last, as a Hugging Face model's are),
"multilabel" (bce_with_logits: one logit per label) or "value" (anything else); under
loss="model" the model's own (`_model_output.model_head`: its config's problem_type, else the
width of its logits). What is written (`output=`):
- "prediction": a class head's argmax over its last dimension (long), a multilabel head's
  logits > 0 (long, 0 or 1), a value head's value (double);
- "probability": softmax over the class dimension, the sigmoid of a multilabel head's logits;
- "raw": the output as the model returned it (double).
A row's result of shape () is a scalar, (K,) an array, (T, K) nested arrays. A multilabel or
value output of shape (1,) is written as a scalar. An output whose first dimension after the
batch follows the padded length of a ragged input (a per-token output) is cut, row by row, to
the length of that row of the input it follows (`columns.row_lengths`: with
`fit(preprocess=)`, the ragged columns it passes through; what it returns is written at the
length it returns). Which input: the probe lengthens all ragged inputs together, then, where
there are several, each alone; a model whose inputs must share a length (ids and their mask)
refuses those, and its outputs follow the first. One shorter than its input's row (a model
that caps the length) is a ModelError naming both.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from sparkdl_avg._errors import ConfigError, ModelError
from sparkdl_avg.data.probe_batch import RAGGED_LENGTH, probe_batch
from sparkdl_avg.data.schema import DataSchema

HEADS = ("class", "multilabel", "value")
OUTPUTS = ("prediction", "probability", "raw")
_HEAD_OF_LOSS = {"cross_entropy": "class", "bce_with_logits": "multilabel", "model": "class"}


def output_heads(loss) -> tuple[str, ...]:
    """Each model output's head, from `fit`'s `loss` (a name, a callable, or a list of
    them): a callable loss is a "value" head."""
    losses = loss if isinstance(loss, (list, tuple)) else [loss]
    return tuple(_HEAD_OF_LOSS.get(x, "value") if isinstance(x, str) else "value"
                 for x in losses)


def heads_of(objective) -> tuple[str, ...]:
    """Each output's head from a fit's objective (`_losses.Objective`): one callable given
    every output (`joint`) makes each a "value"."""
    if objective.joint:
        return ("value",) * objective.num_outputs
    return output_heads(objective.losses)


def output_names(schema: DataSchema, count: int) -> tuple[str, ...]:
    """The struct fields of a model with several outputs: its label columns (`label_col` as
    a list), else output_0, output_1, ..."""
    if len(schema.labels) == count:
        return tuple(f.name for f in schema.labels)
    return tuple(f"output_{i}" for i in range(count))


@dataclass(frozen=True, slots=True)
class OutputSpec:
    """One model output, written one way."""

    name: str
    head: str
    mode: str
    """"prediction", "probability" or "raw"."""
    rank: int
    """Dimensions of a row's result: 0 a scalar, 1 an array, 2 nested arrays..."""
    integer: bool
    """Written as long (else double)."""
    cut_to: int | None
    """The ragged input (its index among the model's inputs) whose rows' lengths cut this
    output's first dimension after the batch; None: not cut."""

    def arrow_type(self) -> pa.DataType:
        out = pa.int64() if self.integer else pa.float64()
        for _ in range(self.rank):
            out = pa.list_(out)
        return out

    def spark_type(self):
        from pyspark.sql import types as T

        out = T.LongType() if self.integer else T.DoubleType()
        for _ in range(self.rank):
            out = T.ArrayType(out)
        return out


@dataclass(frozen=True, slots=True)
class Outputs:
    """What one scoring call writes: per mode, per model output, an `OutputSpec`.
    `several`: the model returns a tuple (written as a struct, a field per output); several
    modes are a struct with a field per mode."""

    modes: tuple[str, ...]
    specs: tuple[tuple[OutputSpec, ...], ...]
    several: bool

    def spark_type(self):
        from pyspark.sql import types as T

        def of_mode(specs):
            if not self.several:
                return specs[0].spark_type()
            return T.StructType([T.StructField(s.name, s.spark_type()) for s in specs])

        if len(self.modes) == 1:
            return of_mode(self.specs[0])
        return T.StructType([T.StructField(m, of_mode(s)) for m, s in
                             zip(self.modes, self.specs, strict=True)])

    def assemble(self, arrays: list[list[pa.Array]]) -> pa.Array:
        """Per mode, per output, one Arrow array -> the column's array."""
        def of_mode(specs, outs):
            if not self.several:
                return outs[0]
            return pa.StructArray.from_arrays(outs, names=[s.name for s in specs])

        modes = [of_mode(s, a) for s, a in zip(self.specs, arrays, strict=True)]
        return modes[0] if len(modes) == 1 else pa.StructArray.from_arrays(
            modes, names=list(self.modes))

    def empty(self) -> pa.Array:
        return self.assemble([[pa.array([], s.arrow_type()) for s in specs]
                              for specs in self.specs])


def check_modes(output) -> tuple[str, ...]:
    modes = (output,) if isinstance(output, str) else tuple(output)
    bad = [m for m in modes if m not in OUTPUTS]
    if bad or not modes:
        raise ConfigError(f"output={output!r} is not supported; use one of {list(OUTPUTS)}")
    return modes


def describe_outputs(model, schema: DataSchema, heads: tuple[str, ...], modes: tuple[str, ...],
                     names: tuple[str, ...] | None = None) -> Outputs:
    """Run `model` (on the CPU, in eval mode) on the probe batch of `schema`'s inputs (a
    second time with longer ragged rows, to see which outputs follow their length) and
    describe what scoring writes for it."""
    import torch

    dtype = float_dtype_of(model)
    bad = [h for h in heads if h not in HEADS]
    if bad or not heads:
        raise ConfigError(f"heads={heads!r}: each must be one of {list(HEADS)}")
    ragged = [(i, f.wire) for i, f in enumerate(schema.inputs) if f.ragged]
    with torch.no_grad():
        short = _outputs(model, schema, probe_batch(schema, dtype).inputs)
        longer = _outputs(model, schema, probe_batch(schema, dtype, lengths={
            wire: RAGGED_LENGTH + 1 for _, wire in ragged}).inputs) if ragged else short
        alone = _each_alone(model, schema, dtype, ragged) if len(ragged) > 1 else {}
    several = isinstance(short, (tuple, list))
    short, longer = (tuple(short), tuple(longer)) if several else ((short,), (longer,))
    alone = {i: tuple(out) if several else (out,) for i, out in alone.items()}
    first = ragged[0][0] if ragged else None
    if len(short) != len(heads):
        raise ModelError(f"the model returns {len(short)} output(s), but the fit's loss "
                         f"describes {len(heads)}: {list(heads)}")
    names = names or output_names(schema.without_targets(), len(short))
    if any(m != "prediction" for m in modes) and all(h == "value" for h in heads):
        raise ConfigError(f"output={modes if len(modes) > 1 else modes[0]!r} needs a "
                          "classifier (a cross_entropy or bce_with_logits output); this "
                          "model's outputs are values: use output='prediction'")
    specs = tuple(tuple(_spec(name, head, mode, a, longer[k], first,
                              {i: out[k] for i, out in alone.items()})
                        for k, (name, head, a) in enumerate(zip(names, heads, short,
                                                                strict=True)))
                  for mode in modes)
    return Outputs(modes=modes, specs=specs, several=several)


def _outputs(model, schema: DataSchema, inputs):
    import torch

    try:
        out = schema.call(model, inputs)
    except Exception as exc:
        shapes = ", ".join(f"{f.name}: {tuple(t.shape)} {t.dtype}"
                           for f, t in zip(schema.inputs, inputs, strict=True))
        raise ModelError(f"the model's forward failed on a probe batch ({shapes}): "
                         f"{exc!r}") from exc
    for o in out if isinstance(out, (tuple, list)) else (out,):
        if not isinstance(o, torch.Tensor) or o.dim() == 0:
            raise ModelError(f"the model must return a tensor with a batch dimension, or a "
                             f"tuple of them; got {type(o).__name__}")
    return out


def _each_alone(model, schema: DataSchema, dtype, ragged: list) -> dict:
    """The outputs with each ragged input (by index) lengthened alone; none for one the
    model refuses so (inputs that must share a length)."""
    alone = {}
    for i, wire in ragged:
        try:
            alone[i] = _outputs(model, schema, probe_batch(
                schema, dtype, lengths={wire: RAGGED_LENGTH + 1}).inputs)
        except ModelError:
            continue
    return alone


def _spec(name, head, mode, short, longer, first: int | None, alone: dict) -> OutputSpec:
    """`longer`: this output with every ragged input lengthened; `alone`: with each alone,
    by index (where the model takes that); `first`: the first ragged input's index."""
    if head == "class" and short.dim() < 2:
        raise ModelError(f"output {name!r} is a classifier's (cross_entropy) but has shape "
                         f"{tuple(short.shape)}: it needs a class dimension, last")
    a, b = convert(short, head, mode), convert(longer, head, mode)
    follows = first is not None and a.dim() >= 2 and a.shape[1] == RAGGED_LENGTH \
        and b.shape[1] == RAGGED_LENGTH + 1
    cut_to = next((i for i, out in alone.items()
                   if convert(out, head, mode).shape[1] == RAGGED_LENGTH + 1), first) \
        if follows else None
    return OutputSpec(name=name, head=head, mode=mode, rank=a.dim() - 1,
                      integer=not a.is_floating_point(), cut_to=cut_to)


def convert(out, head: str, mode: str, squeeze: bool = True):
    """One output tensor `[B, ...]` as written in `mode` (see the module's docstring); a
    `[B, 1]` value is one scalar a row, unless `squeeze` is off (a per-token output of a
    chunk whose rows are all one step long)."""
    import torch

    if head == "value" or mode == "raw":
        t = out
    elif mode == "probability":
        t = torch.softmax(out.double(), -1) if head == "class" else torch.sigmoid(out.double())
    else:
        t = out.argmax(-1) if head == "class" else (out > 0)
    if squeeze and head != "class" and t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    return t.long() if not t.is_floating_point() else t.double()


def to_arrow(t, lengths=None) -> pa.Array:
    """A converted output `[rows, *dims]` (a torch tensor) as an Arrow column of nested lists;
    with `lengths` (a torch tensor), its first dimension after the rows cut to them."""
    import torch

    if lengths is not None:
        keep = torch.arange(t.shape[1], device=t.device)[None, :] < lengths[:, None]
        values = _nest(t[keep].cpu().numpy())
        offsets = np.zeros(len(lengths) + 1, np.int64)
        np.cumsum(lengths.cpu().numpy(), out=offsets[1:])
        return pa.ListArray.from_arrays(_offsets(offsets), values)
    return _nest(t.cpu().numpy())


def _nest(values: np.ndarray) -> pa.Array:
    """`[n, *dims]` -> n rows of nested lists (dims empty: n scalars)."""
    out = pa.array(values.reshape(-1))
    for level in range(values.ndim - 1, 0, -1):
        parents = int(np.prod(values.shape[:level]))
        out = pa.ListArray.from_arrays(
            _offsets(np.arange(parents + 1, dtype=np.int64) * values.shape[level]), out)
    return out


def _offsets(offsets: np.ndarray) -> pa.Array:
    return pa.array(offsets, pa.int32())  # a batch's values: far fewer than 2**31


def float_dtype_of(model):
    """The model's floating dtype: what its float inputs are given as."""
    import torch

    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32
