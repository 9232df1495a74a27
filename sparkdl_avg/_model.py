"""What the user gives, built and checked: the model (`model_fn`), its optimizer and its loss,
and the callables pickled for the executors. Used on the driver and in the tasks."""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import inspect
import logging
import os
import re
import sys
import sysconfig
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

import cloudpickle
import torch

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._errors import ConfigError, ModelError
from sparkdl_avg.averaging.flat_buffer import averaged_tensors


def build_model(model_fn: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    if not callable(model_fn) or isinstance(model_fn, torch.nn.Module):  # its call: forward
        raise ModelError("model_fn must be a zero-argument callable that builds the model (its "
                         f"class, or a function), got a {type(model_fn).__name__} object")
    try:
        model = model_fn()
    except Exception as exc:
        raise ModelError(f"model_fn() failed to build the model: {exc!r}") from exc
    if not isinstance(model, torch.nn.Module):
        raise ModelError(f"model_fn() must return a torch.nn.Module, got {type(model).__name__}")
    return settle_modes(model)


LIBRARY_LOGGERS = ("", "transformers")
"""The loggers a model's libraries warn through while model_fn builds: the root (PEFT's and
most libraries' records propagate there; an executor's has no handler, so Python's last
resort prints them) and transformers' own, which does not propagate."""


@contextlib.contextmanager
def heard_warnings(*, replay: bool):
    """Python warnings and log records at WARNING or above raised in this thread inside (the
    build of model_fn: transformers' and PEFT's), as texts in the list it yields, filled on
    the way out. `replay`: then shown as they would have been (the driver's build: once);
    else dropped (a task's: every executor process would print them again). Other records
    (lower levels, other threads) are passed on as they were, on the way out."""
    heard: list[str] = []
    recorder = _Recorder()
    loggers = [logging.getLogger(name) for name in LIBRARY_LOGGERS]
    saved = [logger.handlers for logger in loggers]
    for logger in loggers:
        logger.handlers = [recorder]
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            yield heard
    finally:
        for logger, handlers in zip(loggers, saved, strict=True):
            # kept: a handler the build added (transformers' own, on its first import)
            logger.handlers = handlers + [h for h in logger.handlers
                                          if h is not recorder and h not in handlers]
        heard += [f"{w.category.__name__}: {w.message}" for w in caught]
        if replay:
            for w in caught:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno,
                                       source=w.source)
        mine = threading.get_ident()
        for record in recorder.records.values():
            ours = record.levelno >= logging.WARNING and record.thread == mine
            if ours:
                heard.append(record.getMessage())
            if replay or not ours:
                logging.getLogger(record.name).handle(record)


class _Recorder(logging.Handler):
    """Keeps each record once (one that propagates meets it on two loggers)."""

    def __init__(self) -> None:
        super().__init__()
        self.records: dict[int, logging.LogRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.records.setdefault(id(record), record)


def settle_modes(model: torch.nn.Module) -> torch.nn.Module:
    """The modes `model` trains in: each module the one model_fn left it in, except that a
    model wholly in eval mode (as `from_pretrained` returns one) trains wholly in training
    mode. Applied on the driver and in every replica, so both average the same tensors."""
    if not any(m.training for m in model.modules()):
        model.train()
    return model


def eval_mode_trainers(model: torch.nn.Module) -> list[str]:
    """The modules in eval mode that hold parameters which train (themselves or below):
    they train with dropout off and BatchNorm statistics frozen. Outermost first."""
    found: list[str] = []
    for name, module in model.named_modules():
        if module.training or any(f == "" or name.startswith(f + ".") for f in found):
            continue
        if any(p.requires_grad for p in module.parameters()):
            found.append(name)
    return found


@contextlib.contextmanager
def evaluating(model: torch.nn.Module):
    """The model in eval mode, and then each module back in the mode it was in (a frozen
    part model_fn put in eval mode stays so; `model.train()` would flip it)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, training in modes:
            m.training = training


def pickle_for_executors(name: str, value: object) -> bytes:
    """Cloudpickle a user callable now, so one that cannot travel fails before any task.

    A callable from the user's own modules (a job script's helper, a test file) travels by
    value: executors do not have those modules. Installed packages travel by reference."""
    modules = [m for m in _modules_of(value) if _is_user_module(m)]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps(value)
    except Exception as exc:
        raise ModelError(
            f"{name} cannot be pickled for the executors: {exc!r}. Define it at module level "
            "or make everything it captures picklable (no SparkSession, sockets or locks)."
        ) from exc
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def _modules_of(value: object, depth: int = 0) -> set[ModuleType]:
    """The modules a callable comes from: its own, its class's and their base classes', for
    a function those of the classes and functions it names from its module, for a
    `functools.partial` those of the function and of its arguments, for a dataclass instance
    those of its callables, alone or in a tuple or list (a few levels deep). Only what
    `getattr` gives is walked: an attribute it cannot give (a dataclass type's field with a
    `default_factory`, a property that raises) is no module of the value's."""
    found = set()
    classes = [value] if isinstance(value, type) else []
    classes.append(type(value))
    for obj in (value, *(base for cls in classes for base in cls.__mro__)):
        name = _attribute(obj, "__module__")
        module = sys.modules.get(name) if isinstance(name, str) else None
        if module is not None:
            found.add(module)
    code = _attribute(value, "__code__")
    if inspect.iscode(code) and depth < 3:  # a factory naming a class of the user's
        names = _attribute(value, "__globals__")
        names = names if isinstance(names, dict) else {}
        for name in code.co_names:
            named = names.get(name)
            if isinstance(named, type) or inspect.isfunction(named):
                found |= _modules_of(named, depth + 1)
    if isinstance(value, functools.partial) and depth < 3:
        for part in (value.func, *value.args, *value.keywords.values()):
            found |= _modules_of(part, depth + 1)
    # a TrainConfig's optimizer factory, an objective's loss callables and its metrics'
    # (`_metrics.Metric`): an instance's fields (a dataclass type, such as PEFT's LoraConfig
    # named by a factory, holds no values)
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and depth < 3:
        for f in dataclasses.fields(value):
            held = _attribute(value, f.name)
            for part in held if isinstance(held, (tuple, list)) else (held,):
                if callable(part) or (dataclasses.is_dataclass(part)
                                      and not isinstance(part, type)):
                    found |= _modules_of(part, depth + 1)
    return found


def _attribute(obj: object, name: str):
    """`obj.name`, or None where getting it fails in any way (user code may run)."""
    try:
        return getattr(obj, name, None)
    except Exception:  # noqa: BLE001 - an attribute that cannot be read names no module
        return None


def _is_user_module(module: ModuleType) -> bool:
    path = getattr(module, "__file__", None)
    if module.__name__ == "__main__" or not path or module.__name__.startswith("sparkdl_avg"):
        return False
    return not is_installed_file(path)


def is_installed_file(path: str) -> bool:
    """Whether `path` lies in the standard library or a site directory: not the user's own
    code (a local folder, an editable install)."""
    installed = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib",
                                                    "platlib")}
    path = os.path.realpath(path)
    if any(path.startswith(os.path.realpath(p) + os.sep) for p in installed):
        return True
    # a site directory sysconfig does not name: the user's, a notebook-scoped environment's
    return not {"site-packages", "dist-packages"}.isdisjoint(path.split(os.sep))


def model_dtype(model: torch.nn.Module) -> torch.dtype:
    dtypes = {t.dtype for t in averaged_tensors(model)}
    if not dtypes:
        raise ModelError("the model has no parameters to train")
    if len(dtypes) > 1:
        raise ModelError(
            f"the model mixes parameter dtypes {sorted(map(str, dtypes))}; convert it to one "
            "dtype (e.g. model.float() or model.double()) in model_fn"
        )
    dtype = dtypes.pop()
    if dtype == torch.float16:
        raise ModelError(
            "the model's parameters are float16: trained as they are (no autocast, no loss "
            "scaling), gradients underflow and Adam's second moment overflows to inf/NaN. Keep "
            "the parameters in float32 in model_fn and set TrainConfig(precision=\"fp16\") "
            "to compute in float16 (autocast and loss scaling, on CUDA), or "
            "precision=\"bf16\"; or make the parameters bfloat16, whose range is float32's")
    if dtype not in (torch.bfloat16, torch.float32, torch.float64):
        raise ModelError(f"parameters of dtype {dtype} cannot be trained")
    return dtype


def make_optimizer(config: TrainConfig, params: Any) -> torch.optim.Optimizer:
    """The built-in optimizer named in `config`, or `config.optimizer(params)` for a user
    callable."""
    if callable(config.optimizer):
        opt = config.optimizer(params)
        if not isinstance(opt, torch.optim.Optimizer):
            raise ConfigError(
                f"optimizer callable returned {type(opt).__name__}, not a torch.optim.Optimizer"
            )
        return opt
    if config.optimizer == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay)
    # The fused kernel is ~2x faster than the per-tensor loop on CPU (9 vs 17 ms a step for the
    # MNIST-1D MLP) and works on GPUs too; older torch builds lack it for CPU tensors.
    kind = torch.optim.AdamW if config.optimizer == "adamw" else torch.optim.Adam
    params = list(params)
    try:
        return kind(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    except (RuntimeError, TypeError, ValueError):
        return kind(params, lr=config.lr, weight_decay=config.weight_decay)


def check_model_takes_data(model: torch.nn.Module, schema, objective, *, dtype: torch.dtype,
                           ranges: dict, longest: dict, batch=None):
    """Run the model once, on the driver, on a probe batch of two rows with the data's real
    dtypes and shapes: each integer field holds its least value in the first row and its
    largest in the second (an embedding too small fails here, not in a task), each ragged
    field its longest row; or on `batch` (real rows: `fit(preprocess=)`'s sample), whose
    integer fields that `ranges` names hold their least and largest values the same way
    (`probe_batch.with_ranges`). Then check its outputs against the labels
    (`check_outputs`) and the fit's metrics (`_metrics.check_metrics`), and return them."""
    from sparkdl_avg._losses import check_outputs
    from sparkdl_avg.data.probe_batch import probe_batch, with_ranges

    _check_keywords(model, schema, objective.model_loss)
    known = {wire: r for wire, r in ranges.items() if r is not None}
    low = {w: int(r[0]) for w, r in known.items()}
    high = {w: int(r[1]) for w, r in known.items()}
    batch = probe_batch(schema, dtype, low=low, high=high, lengths=longest) \
        if batch is None else with_ranges(batch, schema, low=low, high=high)
    try:
        with evaluating(model), torch.no_grad():
            out = schema.call(model, batch.inputs, objective.model_labels(batch.labels))
    except IndexError as exc:
        if "out of range" not in str(exc):
            raise _forward_failed(schema, batch, exc) from exc
        raise index_error(schema, batch.inputs, exc) from exc
    except Exception as exc:
        raise _forward_failed(schema, batch, exc) from exc
    # its messages say "label column 'y'": the column's name, not its description
    check_outputs(objective, out, batch.labels, [f.column for f in schema.labels])
    if objective.metrics:  # each metric once on these outputs: one that cannot score fails
        from sparkdl_avg._metrics import check_metrics
        from sparkdl_avg._model_output import logits_of

        rows = batch.labels[0].shape[0]
        weights = torch.ones(rows, dtype=torch.float64) if objective.weighted else None
        with torch.no_grad():
            check_metrics(objective.metrics, logits_of(out), batch.labels, weights)
    return out


def _forward_failed(schema, batch, exc: BaseException) -> ModelError:
    shapes = ", ".join(f"{f.name}: {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}"
                       for f, x in zip(schema.inputs, batch.inputs, strict=True))
    per_row = f"; {schema.num_features} features per row" \
        if schema.num_features is not None else ""
    return ModelError(f"the model's forward failed on a probe batch of the data's "
                      f"shapes ({shapes}{per_row}): {exc!r}{_dtype_hint(schema, batch, exc)}")


_DTYPE_CLASH = re.compile(r"dtype|datatype|scalar type|Input type|\w+Tensor\b")
"""How torch words a layer given a tensor of another dtype: a Conv's "Input type (unsigned
char) and bias type (float)", a Linear's "must have the same dtype", an Embedding's
"scalar types: Long, Int; but got torch.ByteTensor"."""


def _dtype_hint(schema, batch, exc: BaseException) -> str:
    """For a dtype clash: what the model received for each integer input and what to do."""
    if not _DTYPE_CLASH.search(str(exc)):
        return ""
    hints = []
    for f, x in zip(schema.inputs, batch.inputs, strict=True):
        if x.dtype == torch.uint8:
            hints.append(f"{f.described} reaches the model as uint8 (what preprocess "
                         "returned): a float layer takes it as x.float() / 255 in forward "
                         "(or return float32 from preprocess); an nn.Embedding takes int64 "
                         "ids (return them as int64)")
        elif x.dtype == torch.int64:
            hints.append(f"{f.described} reaches the model as int64: a float layer takes "
                         "it as x.float() in forward (or cast the column to float)")
    return ". " + "; ".join(hints) if hints else ""


def index_error(schema, inputs, exc: BaseException) -> ModelError:
    """A ModelError for an index out of range in the model (an nn.Embedding given an id
    beyond its table), naming each integer input and the largest id it held."""
    seen = [f"{f.described} up to {int(x.max())}" for f, x in zip(schema.inputs, inputs,
                                                                     strict=True)
            if f.kind == "int" and x.numel()]
    return ModelError(f"the model indexed out of range ({exc}): the batch held ids "
                      f"{'; '.join(seen) or 'in no integer input'}. Size each nn.Embedding "
                      "for the largest id its column holds (num_embeddings = largest + 1)")


def _check_keywords(model: torch.nn.Module, schema, model_loss: bool) -> None:
    """Inputs bound by name must be parameters of forward, and so must `labels` under
    loss="model". A forward taking **kwargs (every transformers 5 model's, PEFT's) passes
    them on, so a misspelled name would be swallowed: its names are those of every forward
    along the wrapped chain (`_forward_names`); only a chain that names none is trusted."""
    from sparkdl_avg._model_output import LABELS_PARAMETER

    if schema.binding != "keyword" and not model_loss:
        return
    names, where = _forward_names(model)
    if names is None:
        return
    bound = [(f.name, f"inputs binds {f.name!r} (column {f.column!r})")
             for f in (schema.inputs if schema.binding == "keyword" else ())]
    if model_loss:
        bound.append((LABELS_PARAMETER, "loss='model' gives the labels to forward as labels="))
    for name, what in bound:
        if name not in names:
            hint = difflib.get_close_matches(name, names, n=1)
            fix = f" (did you mean {hint[0]!r}?)" if hint else ""
            use = ". Use a built-in or callable loss" if name == LABELS_PARAMETER else ""
            raise ModelError(f"{what}, but {where} has no such parameter{fix}; its "
                             f"parameters: {names}{use}"[:1000])


def _forward_names(model: torch.nn.Module) -> tuple[list[str] | None, str]:
    """(the parameter names forward can take, what to call it in a message); None: any.

    Without **kwargs, forward's own. With them, those of every forward along the chain of
    wrapped models (PEFT's `get_base_model()`, a `base_model` or `model` attribute): a
    PEFT model's forward is (*args, **kwargs), its base model's names the parameters."""
    names: list[str] = []
    chain, module = [], model
    while isinstance(module, torch.nn.Module) and module not in chain and len(chain) < 8:
        chain.append(module)
        params = inspect.signature(module.forward).parameters.values()
        names += [p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
                  and p.name not in names]
        if not any(p.kind is p.VAR_KEYWORD for p in params):
            break  # this forward takes nothing more: what it names is all
        module = _wrapped(module)
    where = " or ".join(f"{type(m).__name__}.forward" for m in chain)
    return (names or None), where


def _wrapped(module: torch.nn.Module):
    """The model `module` wraps and passes its keywords to, if it says: PEFT's base model,
    else a `base_model` or `model` attribute; None."""
    get_base = getattr(module, "get_base_model", None)
    if callable(get_base):
        return get_base()
    for attribute in ("base_model", "model"):
        inner = getattr(module, attribute, None)
        if isinstance(inner, torch.nn.Module) and inner is not module:
            return inner
    return None
