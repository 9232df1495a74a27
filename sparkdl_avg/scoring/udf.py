"""Scoring a DataFrame with a trained model on the executors, batched through Arrow.

`make_predict_udf` is an iterator Arrow UDF over the model's input columns (one argument per
input, in the fit's order; on pyspark 4.0 an iterator pandas UDF around the same function:
`_spark_compat.batch_udf`): each task unpickles the model once, puts it on the GPU Spark gave
the task (else the CPU), reads each Arrow batch's columns into numpy without a Python loop over
rows (`data/arrow_columns`), and scores `batch_size` rows per forward call. What it writes, and
its Spark type, were decided on the driver (`outputs.describe_outputs`)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pyarrow as pa
import torch

from sparkdl_avg._errors import ConfigError, ModelError
from sparkdl_avg._model import pickle_for_executors
from sparkdl_avg._spark_compat import batch_udf
from sparkdl_avg.data.arrow_columns import Column
from sparkdl_avg.data.schema import DataSchema
from sparkdl_avg.scoring import columns as cols
from sparkdl_avg.scoring.outputs import (
    Outputs,
    check_modes,
    convert,
    describe_outputs,
    float_dtype_of,
    to_arrow,
)


def make_predict_udf(model: torch.nn.Module, *, schema: DataSchema, heads: tuple[str, ...],
                     output="prediction", names: tuple[str, ...] | None = None,
                     device: str = "auto", batch_size: int = 8192, preprocess=None,
                     model_schema: DataSchema | None = None, idents: bool = False) -> Callable:
    """A column function of the model's inputs (`schema`'s, in order) giving its outputs as
    `output` says ("prediction", "probability" or "raw"; a tuple of them: a struct with a
    field per mode). `heads`: each output's head (`outputs.output_heads`); `names`: the
    struct fields of a model with several outputs. A batch with a null, NaN or infinite
    input fails the task with a DataError naming the column. `preprocess` (with
    `model_schema`, the inputs it returns): run with training=False on each chunk's raw
    input columns. `idents`: the function takes `schema`'s identifying column after the
    inputs (`transform` passes it where the frame has it), by which an error of
    `preprocess` names its row."""
    check_scoring(device, batch_size)
    schema = schema.without_targets(idents=idents and preprocess is not None)
    model_in = (model_schema or schema).without_targets()
    model = copy.deepcopy(model).cpu().eval()  # the caller's model stays where it is
    outputs = describe_outputs(model, model_in, tuple(heads), check_modes(output), names)
    payload = pickle_for_executors("model", model)
    prep = None if preprocess is None else pickle_for_executors("preprocess", preprocess)

    def predict(batches: Iterator[tuple[pa.Array, ...]]) -> Iterator[pa.Array]:
        try:
            yield from _predict_batches(payload, batches, schema=schema, outputs=outputs,
                                        device=device, batch_size=batch_size,
                                        preprocess=prep, model_schema=model_in)
        finally:
            _release_gpu()

    return batch_udf(predict, outputs.spark_type())


def check_scoring(device: str, batch_size: int) -> None:
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")


def _predict_batches(payload: bytes, batches: Iterator, *, schema: DataSchema,
                     outputs: Outputs, device: str, batch_size: int, preprocess=None,
                     model_schema: DataSchema | None = None) -> Iterator[pa.Array]:
    import cloudpickle

    from sparkdl_avg.task.device import task_device

    target = torch.device(task_device(device).device)
    if target.type == "cuda":  # as training does: model code that says .cuda() lands here
        torch.cuda.set_device(target)
    model = cloudpickle.loads(payload).to(target).eval()
    scorer = Scorer(model, model_schema or schema, outputs, target, batch_size)
    if preprocess is not None:
        from sparkdl_avg.data.feed import Preprocessor

        scorer.preprocessor = Preprocessor(cloudpickle.loads(preprocess), schema, model_schema,
                                           scorer.float_dtype, seed=0, partition=0)
    for batch in batches:  # one argument: an array; several: a tuple of them
        arrays = batch if isinstance(batch, tuple) else (batch,)
        yield scorer.score(cols.read_arrow(arrays, schema))


class Scorer:
    """A model (on `device`, in eval mode) scoring columns `batch_size` rows per forward
    call."""

    def __init__(self, model: torch.nn.Module, schema: DataSchema, outputs: Outputs,
                 device: torch.device, batch_size: int) -> None:
        self.model = model
        self.schema, self.outputs = schema, outputs
        self.device, self.batch_size = device, batch_size
        self.float_dtype = float_dtype_of(self.model)
        self.preprocessor = None
        """A `data.feed.Preprocessor` (`fit(preprocess=)`): the columns are its raw ones."""

    def score(self, columns: list[Column]) -> pa.Array:
        rows = cols.rows_of(columns)
        if rows == 0:
            return self.outputs.empty()
        parts = [[[] for _ in specs] for specs in self.outputs.specs]
        with torch.no_grad():
            for start in range(0, rows, self.batch_size):
                inputs, lengths = self._chunk(columns, start, min(start + self.batch_size,
                                                                  rows))
                out = self.schema.call(self.model, inputs)
                out = tuple(out) if self.outputs.several else (out,)
                for mode_parts, specs in zip(parts, self.outputs.specs, strict=True):
                    for part, spec, o in zip(mode_parts, specs, out, strict=True):
                        cut = None if spec.cut_to is None else lengths[spec.cut_to]
                        if cut is not None and len(cut) and o.shape[1] < int(cut.max()):
                            raise self._shorter(spec, o.shape[1], int(cut.max()))
                        part.append(to_arrow(convert(o, spec.head, spec.mode,
                                                     squeeze=cut is None), cut))
        return self.outputs.assemble([[_concat(p) for p in mode_parts] for mode_parts in parts])

    def _shorter(self, spec, positions: int, longest: int) -> ModelError:
        name = self.schema.inputs[spec.cut_to].name
        return ModelError(
            f"output {spec.name!r} follows the length of input {name!r}, but has {positions} "
            f"positions where a row of it has {longest}: a per-token output is cut to its "
            "input's rows, so it must keep their length (give a model that truncates its "
            "input rows no longer than it keeps)")

    def _chunk(self, columns: list[Column], start: int, stop: int):
        if self.preprocessor is None:
            return cols.chunk(columns, self.schema, start, stop, self.float_dtype, self.device)
        from sparkdl_avg.data.feed import EVAL_STREAM, step_rng

        prep = self.preprocessor
        batch = prep([cols.raw_parts(columns, start, stop)], training=False,
                     rng=step_rng(0, EVAL_STREAM, 0, start), offset=start,
                     total=cols.rows_of(columns))
        return tuple(t.to(self.device) for t in batch.inputs), \
            cols.row_lengths(columns, self.schema, start, stop, self.device)


def _concat(arrays: list[pa.Array]) -> pa.Array:
    return arrays[0] if len(arrays) == 1 else pa.concat_arrays(arrays)


def _release_gpu() -> None:
    """Once a task has scored (the model gone with `_predict_batches`' frame): Spark reuses
    the Python worker, and CUDA's cache of the model's and the batches' blocks would hold
    the GPU's memory into the next fit, whose free-memory check would then fail."""
    if torch.cuda.is_initialized():
        from sparkdl_avg.task.memory import release_task_memory

        release_task_memory()
