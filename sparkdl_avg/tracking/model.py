"""The fit's model as an MLflow model: the pytorch flavor (`mlflow.pytorch.load_model` gives the
module) with a pyfunc of our own, so `mlflow.pyfunc.load_model(uri).predict(...)` scores the
fit's inputs as `FitResult.transform` does.

A PEFT model is logged merged into its base (`merged`); a model returning a Hugging Face
`ModelOutput` is logged returning its logits, as the fit's losses and scoring read it.
`log_model="adapters"` logs what trained instead (`save_adapters`), as files, not an MLflow
model.

The torch module is saved by the pytorch flavor as a pt2 export (torch.export, taking the
inputs positionally, the batch and ragged dimensions dynamic); a module torch.export cannot
trace is pickled instead (its class must then be importable where it is loaded, and MLflow
refuses pickles where MLFLOW_ALLOW_PICKLE_DESERIALIZATION=false). The pyfunc's
loader is this module (`_load_pyfunc`): it reads the fit's DataSchema and heads from
`data/sparkdl_avg.json` and scores through `scoring.udf.Scorer`.

The signature lists every input by name with its dtype (as the fit carried it) and row shape,
-1 for the batch dimension: tensor specs when every input has a fixed shape (predict then
takes a dict of numpy arrays, a pandas DataFrame with a list or array per cell, or, for one
input, a numpy array); column specs (nested arrays) when one is ragged, since MLflow reshapes a
DataFrame to tensor specs only for fixed shapes (predict then takes the DataFrame); the model's
metadata lists every input's shape either way. The parameter `output` ("prediction",
"probability", "raw") is `transform`'s.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
import sys
import warnings

import numpy as np
import torch

from sparkdl_avg.tracking.first_use import import_mlflow_pytorch

log = logging.getLogger("sparkdl_avg")
SCHEMA_FILE = "sparkdl_avg.json"
PREPROCESS_FILE = "preprocess.pkl"
RNN_WEIGHTS_WARNING = (r"The tensor attributes? (self\.[\w.]*_flat_weights\[\d+\](, )?)+ "
                       r"(was|were) assigned during export")
"""What torch.export says of every GRU, LSTM and RNN (`_quiet_rnn_export`)."""


def log_model(model, *, schema, heads, names=None, pip_requirements=None,
              registered_model_name: str | None = None, preprocess: bytes | None = None,
              model_schema=None, ahead=None) -> None:
    """Log `model` (`merged`) as "model" to the active run (a new registered version when
    named). `preprocess` (cloudpickled, with `model_schema`, the inputs it returns): the
    model scores the raw columns of `schema` through it, with training=False. `ahead`: the
    same model saved with its initial values while it trained (`tracking.model_ahead`)."""
    from mlflow.models import Model

    Model.log(None, sys.modules[__name__], name="model", torch_model=merged(model),
              schema=schema,
              heads=tuple(heads), names=names, pip_requirements=pip_requirements,
              registered_model_name=registered_model_name, preprocess=preprocess,
              model_schema=model_schema, ahead=ahead)


def save_model(path, mlflow_model, *, torch_model, schema, heads, names=None,
               pip_requirements=None, preprocess: bytes | None = None,
               model_schema=None, ahead=None) -> torch.nn.Module | None:
    """What `mlflow.models.Model.log` calls: the pytorch flavor's files (pt2, else pickle),
    then our pyfunc loader, signature and schema file over them. With `preprocess` the torch
    module takes `model_schema`'s inputs and the signature is `schema`'s raw columns. With
    `ahead`, its saving with `torch_model`'s values put in, where that works. Returns the
    module it exported or pickled (`export_form`), None where it took the saving ahead."""
    from mlflow import pyfunc

    mlflow_pytorch = import_mlflow_pytorch()

    if ahead is not None and ahead.save_trained(path, mlflow_model, torch_model):
        return None
    raw = schema.without_targets()
    inputs = (model_schema or schema).without_targets()
    module, dtype, example = export_form(torch_model, inputs)
    example = tuple(t.numpy() for t in example)
    # the package travels with the model: the pyfunc's loader and scoring are ours
    common = {"mlflow_model": mlflow_model, "pip_requirements": pip_requirements,
              "code_paths": [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]}
    _quiet_rnn_export()
    try:
        mlflow_pytorch.save_model(module.eval(), path, serialization_format="pt2",
                                  input_example=example, signature=tensor_signature(
                                      inputs, varying=preprocess is not None), **common)
        if preprocess is not None:
            _check_export(module, os.path.join(path, mlflow_model.flavors["pytorch"][
                "model_data"]), inputs, dtype)
    except Exception as exc:  # noqa: BLE001 - torch.export refuses many real models
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        log.warning("torch.export could not export the model (%s: %s); it is logged pickled: "
                    "its class must be importable where it is loaded", type(exc).__name__,
                    first)
        shutil.rmtree(path, ignore_errors=True)
        mlflow_model.flavors.clear()
        mlflow_pytorch.save_model(module.eval(), path, serialization_format="pickle",
                                  **common)
    # the pytorch flavor adds no pyfunc for several inputs, and its own takes one tensor
    flavor = mlflow_model.flavors["pytorch"]
    mlflow_model.flavors.pop("python_function", None)
    pyfunc.add_to_model(mlflow_model, loader_module=__name__, data=flavor["model_data"],
                        code=flavor.get("code"), conda_env="conda.yaml",
                        python_env="python_env.yaml")
    mlflow_model.signature = signature(raw)
    # column specs hold no shapes: every input's, -1 for the batch and ragged dimensions
    mlflow_model.metadata = {**(mlflow_model.metadata or {}), "inputs": [
        {"name": f.key, "dtype": f.dtype, "shape": list(_spec_shape(f))}
        for f in raw.inputs]}
    data = os.path.join(path, flavor["model_data"])
    if preprocess is not None:  # unpickled only by the pyfunc's loader, as a pickled module is
        with open(os.path.join(data, PREPROCESS_FILE), "wb") as f:
            f.write(preprocess)
    with open(os.path.join(data, SCHEMA_FILE), "w") as f:
        json.dump({"schema": schema.to_dict(), "heads": list(heads),
                   "names": list(names) if names else None,
                   "model_schema": model_schema.to_dict() if preprocess is not None
                   else None}, f)
    mlflow_model.save(os.path.join(path, "MLmodel"))
    return module


def export_form(torch_model, inputs) -> tuple[torch.nn.Module, torch.dtype, tuple]:
    """What is exported of `torch_model` for the inputs `inputs` (a DataSchema): a copy
    owning its tensors, in float32 or float64, called positionally and returning tensors;
    its dtype; and the probe batch it is exported on."""
    from sparkdl_avg.data.probe_batch import probe_batch

    module, dtype = _owning_copy(torch_model), next(torch_model.parameters()).dtype
    if dtype not in (torch.float32, torch.float64):  # numpy has no bfloat16
        module, dtype = module.float(), torch.float32
    example = probe_batch(inputs, dtype).inputs
    if inputs.binding == "keyword" or _returns_model_output(module, example):
        module = _Positional(module, inputs)
    return module, dtype, example


def _quiet_rnn_export() -> None:
    """Ignore torch.export's warning that an RNN's `_flat_weights[i]` "were assigned during
    export" (any GRU, LSTM or RNN). That list is nn.RNNBase's cache of its own registered
    parameters: it follows them when export swaps them for its tracing tensors, and export
    restores it afterwards; the parameters themselves are exported as parameters, so the
    logged model is whole (`tests/test_model_logging.py` scores a logged GRU). Matched by its
    whole message, and only while every attribute it names is such a list's item. A filter
    that stays, put first again at each export: one put around the export and removed
    (`catch_warnings`) would undo other threads' filters made meanwhile."""
    warnings.filterwarnings("ignore", message=RNN_WEIGHTS_WARNING, category=UserWarning)


class ExportFixedShape(Exception):
    """torch.export fixed a dimension of what preprocess returns that the model takes at
    other sizes: the export would refuse batches the fit and `transform` score."""


def _check_export(module, data: str, inputs, dtype) -> None:
    """ExportFixedShape when the exported program (in `data`) refuses the probe batch with
    row dimensions (longer than 1) grown by one, where `module` itself takes it: a guard
    torch.export drew from the sample (code branching on a length). The dimensions grow
    together (all at once, and each group of one sample size: a tokenizer's ids and mask
    share a length, and growing one alone makes the model refuse the mismatch) and one at a
    time. A dimension the module refuses too (a Linear's width) is the model's own, and
    fine."""
    from sparkdl_avg.data.probe_batch import probe_batch

    exported = torch.export.load(os.path.join(data, "model.pt2")).module()
    base = probe_batch(inputs, dtype).inputs
    for grown_dims in _growths(base):
        grown = list(base)
        for i, dim in grown_dims:
            shape = list(grown[i].shape)
            shape[dim] += 1
            grown[i] = grown[i].new_zeros(shape)
        if _runs(module, grown) and not _runs(exported, grown):
            named = ", ".join(f"dimension {dim} of {inputs.inputs[i].key!r} at "
                              f"{base[i].shape[dim]}" for i, dim in grown_dims)
            raise ExportFixedShape(
                f"torch.export fixed {named}, which the model takes at other sizes "
                "(preprocess may return other lengths)")


def _growths(base) -> list[tuple[tuple[int, int], ...]]:
    """The sets of (input, dimension) to grow by one: all varying ones, each group sharing a
    sample size, then each alone; without repeats."""
    dims = [(i, dim) for i, t in enumerate(base) for dim in range(1, t.dim())
            if t.shape[dim] > 1]
    by_size: dict[int, list] = {}
    for i, dim in dims:
        by_size.setdefault(base[i].shape[dim], []).append((i, dim))
    out: list[tuple[tuple[int, int], ...]] = []
    for group in (dims, *by_size.values(), *([d] for d in dims)):
        if group and tuple(group) not in out:
            out.append(tuple(group))
    return out


def _runs(module, inputs) -> bool:
    try:
        with torch.no_grad():
            module(*inputs)
    except Exception:  # noqa: BLE001 - any refusal: a guard, a shape mismatch
        return False
    return True


def _spec_shape(field) -> tuple[int, ...]:
    return (-1, *field.shape)  # a ragged field's first dimension is -1 already


def tensor_signature(schema, varying: bool = False):
    """Every input as a tensor spec: dtype as the model gets it, -1 for batch and ragged; the
    pytorch flavor exports the -1 dimensions dynamic (`torch.export.Dim.AUTO`: one the model
    fixes, a Linear's width, is exported static, not refused). `varying`: what a preprocess
    returns, whose lengths may change from batch to batch (a tokenizer padding to the
    longest): every row dimension is -1 too, but one of size 1 in the probe batch (a grey
    image's channel), which torch.export would only specialise, with a warning."""
    from mlflow.models import ModelSignature
    from mlflow.types import Schema, TensorSpec

    def shape(f):
        return (-1, *(-1 if d > 1 else d for d in f.shape)) if varying else _spec_shape(f)

    return ModelSignature(inputs=Schema([
        TensorSpec(np.dtype(_model_dtype(f)), shape(f), f.key) for f in schema.inputs]))


def _model_dtype(field) -> str:
    if field.kind == "int":  # as `FieldSpec.torch_dtype`: a preprocess's uint8 stays uint8
        return "uint8" if field.dtype == "uint8" else "int64"
    return {"bool": "bool"}.get(field.kind, field.dtype)


def signature(schema):
    """The logged signature (see the module's docstring), with the `output` parameter."""
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, DataType, ParamSchema, ParamSpec, Schema, TensorSpec
    from mlflow.types.schema import Array

    params = ParamSchema([ParamSpec("output", DataType.string, "prediction")])
    one = len(schema.inputs) == 1 and schema.binding == "single"
    if not any(f.ragged for f in schema.inputs):
        return ModelSignature(inputs=Schema([
            TensorSpec(np.dtype(f.dtype), _spec_shape(f), None if one else f.key)
            for f in schema.inputs]), params=params)
    columns = []
    for f in schema.inputs:
        if f.encoded:  # a binary or string column (`fit(preprocess=)`), decoded by preprocess
            kind = _image_object() if f.image else DataType.string if f.text else \
                DataType.binary
            columns.append(ColSpec(kind, f.key))
            continue
        # the widest of each kind: MLflow's check refuses to narrow, and a DataFrame built by
        # hand holds Python ints and floats (int64, float64); reading casts them as the fit did
        kind = {"int": DataType.long, "bool": DataType.boolean,
                "float": DataType.double}[f.kind]
        for _ in f.shape:
            kind = Array(kind)
        columns.append(ColSpec(kind, f.key))
    return ModelSignature(inputs=Schema(columns), params=params)


def _image_object():
    """Spark's image struct as an MLflow object: a cell is a dict (or a pyspark Row) of its
    fields. Its ints as longs: MLflow's check refuses a Python int for an `integer`."""
    from mlflow.types import DataType
    from mlflow.types.schema import Object, Property

    from sparkdl_avg.data.schema import IMAGE_FIELDS

    return Object([Property("origin", DataType.string, required=False),
                   *(Property(n, DataType.long) for n in IMAGE_FIELDS),
                   Property("data", DataType.binary)])


def _owning_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers each own their storage. A fit's
    result's parameters are views into one block (the averaged buffer): torch.export's weight
    packaging then finds no tensor owning a group's whole storage and warns (a filter around
    it would change the process's warnings, which is not thread-safe). Costs one copy of the
    model on the driver per logged model. Tied weights stay tied (one Parameter, cloned
    once)."""
    out = copy.deepcopy(module)
    with torch.no_grad():
        for t in (*out.parameters(), *out.buffers()):
            t.data = t.data.clone()
    return out


def merged(model):
    """A PEFT model as the plain model its adapters merge into (`merge_and_unload()` on a
    copy: the fit's result keeps its adapters); any other model as it is."""
    if not callable(getattr(model, "merge_and_unload", None)):
        return model
    return copy.deepcopy(model).merge_and_unload()


def _returns_model_output(module, inputs) -> bool:
    """Whether `module` returns anything but tensors on the probe batch (a ModelOutput)."""
    with torch.no_grad():
        out = module.eval()(*inputs)
    return not all(isinstance(o, torch.Tensor) for o in
                   (out if isinstance(out, (tuple, list)) else (out,)))


class _Positional(torch.nn.Module):
    """A model called positionally, returning tensors: torch.export and the pyfunc pass the
    inputs in order, and a ModelOutput's logits are what is scored (`DataSchema.call`).
    Its forward names one parameter per input (`__signature__`), as torch.export matches its
    dynamic shapes to the forward's parameters."""

    def __init__(self, model, schema) -> None:
        import inspect

        super().__init__()
        self.model, self.names = model, tuple(schema.input_names)

        def forward(*inputs):  # closes over the model, not over self: no cycle to pickle
            return schema.call(model, inputs)

        forward.__signature__ = inspect.Signature([
            inspect.Parameter(f"x{i}", inspect.Parameter.POSITIONAL_OR_KEYWORD)
            for i in range(len(self.names))])
        self.forward = forward


def _load_pyfunc(path: str, model_config=None):
    """MLflow's pyfunc loader: `path` is the model's data folder."""
    from sparkdl_avg.data.schema import DataSchema

    with open(os.path.join(path, SCHEMA_FILE)) as f:
        saved = json.load(f)
    module = import_mlflow_pytorch().load_model(os.path.dirname(os.path.abspath(path)))
    raw = DataSchema.from_dict(saved["schema"]).without_targets()
    schema, preprocess = raw, None
    if saved.get("model_schema"):  # fit(preprocess=): the module takes what it returns
        import cloudpickle

        schema = DataSchema.from_dict(saved["model_schema"]).without_targets()
        with open(os.path.join(path, PREPROCESS_FILE), "rb") as f:
            preprocess = cloudpickle.load(f)
    if schema.binding == "keyword":  # logged through _Positional
        schema = dataclasses.replace(schema, binding="positional")
    names = tuple(saved["names"]) if saved.get("names") else None
    return _PyfuncModel(module, schema, tuple(saved["heads"]), names, raw=raw,
                        preprocess=preprocess)


class _PyfuncModel:
    def __init__(self, module, schema, heads, names, *, raw=None, preprocess=None) -> None:
        self.module, self.schema, self.heads, self.names = module, schema, heads, names
        self.raw, self.preprocess = raw or schema, preprocess
        """`raw`: the columns predict reads; `schema`: the module's inputs (what
        `preprocess`, when the fit had one, returns for them)."""
        self._scorers: dict = {}

    def predict(self, data, params=None):
        """`transform`'s output for the rows of `data`: a numpy array for one output of a
        fixed shape, a pandas Series (a row's value or array) for one ragged output, a pandas
        DataFrame with a column per output for several."""
        from sparkdl_avg.scoring.columns import read_pandas

        scorer = self._scorer((params or {}).get("output", "prediction"))
        result = scorer.score(read_pandas(data, self.raw))
        return _to_python(result, scorer.outputs)

    def _scorer(self, output: str):
        if output not in self._scorers:
            from sparkdl_avg.scoring.outputs import check_modes, describe_outputs
            from sparkdl_avg.scoring.udf import Scorer

            outputs = describe_outputs(self.module, self.schema, self.heads,
                                       check_modes(output), self.names)
            scorer = Scorer(self.module, self.schema, outputs, torch.device("cpu"), 8192)
            if self.preprocess is not None:  # as `udf._predict_batches` sets it
                from sparkdl_avg.data.feed import Preprocessor

                scorer.preprocessor = Preprocessor(self.preprocess, self.raw, self.schema,
                                                   scorer.float_dtype, seed=0, partition=0)
            self._scorers[output] = scorer
        return self._scorers[output]


def _to_python(array, outputs):
    import pyarrow as pa

    [specs] = outputs.specs
    if outputs.several:
        return pa.Table.from_struct_array(array).to_pandas()
    [spec] = specs
    if spec.cut_to is not None:
        return array.to_pandas()
    rows, dims, values = len(array), [], array
    for _ in range(spec.rank):
        dims.append(len(values.flatten()) // max(len(values), 1))
        values = values.flatten()
    return values.to_numpy(zero_copy_only=False).reshape(rows, *dims)
