"""The fit's model saved while it trains, so that logging it after the last round costs a
load, a check and a write instead of an export.

torch.export traces a model for its structure, which training does not change; the values
it traced with only fill the program's state. Its trace costs seconds for small models (a
GRU's unrolls every step: 4.5-12 s for a 40-step one here) and is paid once per fit. So
`SavedAhead` saves the initial model with `tracking.model.save_model`, on a background
thread while the fit trains, and `save_trained` then copies that saving with the trained
values put into the program's state, checked on a random batch against the trained module.
Where anything does not fit (a value the trace specialised on, a state the program lacks,
a module torch.export could not trace), the fit exports afresh as before.

The export sets torch's process-wide "compiling" flag for its duration, which changes the
code paths torch.optim takes on any thread. So it runs ahead only in fits whose driver steps
no torch optimizer while they train (`applies`: no outer optimizer)."""

from __future__ import annotations

import copy
import logging
import os
import shutil
import tempfile
import threading

import torch

log = logging.getLogger("sparkdl_avg")
PROGRAM_FILE = "model.pt2"
_CHECK_FLOOR = 1e-5
"""The least relative difference the trained program may show against the trained module
on the check batch (its outputs' largest magnitude the unit): float32 kernels and the
program's decompositions round differently, by about 1e-7 of that; a value the program
kept from the initial model differs by what training changed."""


def applies(config) -> bool:
    """Whether a fit of `config` saves its model ahead: it logs a whole model, built on the
    driver, whose driver takes no torch optimizer step while it trains."""
    return config.log_model is True and config.driver_model == "full" and \
        config.outer_optimizer == "average"


class SavedAhead:
    """`model` (the driver's, before training) saved by `save_model(**save_kwargs)` into a
    folder of its own, by `save` on another thread; `close` removes it."""

    def __init__(self, model: torch.nn.Module, **save_kwargs) -> None:
        self._model, self._kwargs = model, save_kwargs
        self._folder = tempfile.mkdtemp(prefix="sparkdl-avg-model-ahead-")
        self._saved = None
        """(the MLflow Model it saved, the program's relative difference from the initial
        module on the check batch) once saved with an export."""
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._closed = False

    @property
    def path(self) -> str:
        return os.path.join(self._folder, "model")

    def save(self) -> None:
        try:
            if not self._closed:
                self._saved = self._save()
        except Exception:  # noqa: BLE001 - only a head start: the end exports afresh
            log.debug("saving the model ahead failed", exc_info=True)
        finally:
            with self._lock:
                self._done.set()
                if self._closed:
                    shutil.rmtree(self._folder, ignore_errors=True)

    def _save(self):
        from mlflow.models import Model

        from sparkdl_avg.tracking.model import merged, save_model

        saved = Model()
        module = save_model(self.path, saved, torch_model=merged(self._model), **self._kwargs)
        program_file = _program_file(self.path, saved)
        if not os.path.exists(program_file):  # pickled: nothing traced to reuse
            return None
        return saved, _difference(torch.export.load(program_file).module(), module,
                                  self._check_batch(module))

    def wait(self, timeout: float) -> bool:
        return self._done.wait(timeout)

    def save_trained(self, path: str, mlflow_model, torch_model) -> bool:
        """Save `torch_model` (the trained model, `merged`) at `path` for `mlflow_model` as
        the saving ahead with its values: whether it could (else `path` is left absent)."""
        if not self._done.is_set() or self._saved is None or self._closed:
            return False
        from sparkdl_avg.tracking.model import export_form

        saved, initial_difference = self._saved
        module = export_form(torch_model, self._inputs())[0]
        shutil.copytree(self.path, path)
        try:
            program_file = _program_file(path, saved)
            program = torch.export.load(program_file)
            if not _take_values(program, module):
                raise _NotAhead("the program's state is not the trained module's")
            difference = _difference(program.module(), module, self._check_batch(module))
            if not difference <= max(8 * initial_difference, _CHECK_FLOOR):
                raise _NotAhead(f"the program differs from the trained module by "
                                f"{difference:.3g} of its output (initially "
                                f"{initial_difference:.3g})")
            torch.export.save(program, program_file)
        except Exception as exc:  # noqa: BLE001 - exported afresh instead
            log.debug("the model saved ahead does not take the trained values (%s); exporting "
                      "it afresh", exc)
            shutil.rmtree(path, ignore_errors=True)
            return False
        from mlflow.utils.file_utils import get_total_file_size

        for name in ("flavors", "signature", "saved_input_example_info", "metadata"):
            setattr(mlflow_model, name, copy.deepcopy(getattr(saved, name)))
        mlflow_model.model_size_bytes = get_total_file_size(path)
        mlflow_model.save(os.path.join(path, "MLmodel"))
        return True

    def close(self) -> None:
        """Remove the saving (now, or once `save` ends)."""
        with self._lock:
            self._closed = True
            if self._done.is_set():
                shutil.rmtree(self._folder, ignore_errors=True)

    def _inputs(self):
        schema = self._kwargs.get("model_schema") or self._kwargs["schema"]
        return schema.without_targets()

    def _check_batch(self, module) -> tuple[torch.Tensor, ...]:
        """The probe batch with random floats (zeros would hide most weights), the same
        each time."""
        from sparkdl_avg.data.probe_batch import probe_batch

        dtype = next(module.parameters()).dtype
        generator = torch.Generator().manual_seed(0)
        return tuple(torch.randn(t.shape, generator=generator, dtype=t.dtype)
                     if t.is_floating_point() else t
                     for t in probe_batch(self._inputs(), dtype).inputs)


class _NotAhead(Exception):
    pass


def _program_file(path: str, mlflow_model) -> str:
    return os.path.join(path, mlflow_model.flavors["pytorch"]["model_data"], PROGRAM_FILE)


def _take_values(program, module: torch.nn.Module) -> bool:
    """Put `module`'s parameters and buffers into `program`'s state and constants, by
    name; whether every tensor of its state has one of the same shape and dtype."""
    values = {**dict(module.named_parameters(remove_duplicate=False)),
              **dict(module.named_buffers(remove_duplicate=False))}
    with torch.no_grad():
        for name, tensor in program.state_dict.items():
            value = values.get(name)
            if value is None or value.shape != tensor.shape or value.dtype != tensor.dtype:
                return False
            tensor.copy_(value)
        for name, tensor in program.constants.items():  # non-persistent buffers
            value = values.get(name)
            if isinstance(tensor, torch.Tensor) and value is not None \
                    and value.shape == tensor.shape and value.dtype == tensor.dtype:
                tensor.copy_(value)
    return True


def _difference(program_module, module: torch.nn.Module, batch) -> float:
    """The largest difference between the two modules' outputs on `batch`, relative to the
    largest magnitude of `module`'s (NaN where either is not finite)."""
    with torch.no_grad():
        got, want = _tensors(program_module(*batch)), _tensors(module.eval()(*batch))
    if [g.shape for g in got] != [w.shape for w in want]:
        return float("nan")
    scale = max((w.abs().max().item() for w in want if w.numel()), default=0.0)
    pairs = zip(got, want, strict=True)
    worst = max(((g.double() - w.double()).abs().max().item() for g, w in pairs if w.numel()),
                default=0.0)
    return worst / max(scale, 1e-30)


def _tensors(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []
