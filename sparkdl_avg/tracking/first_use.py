"""What a fit logs at its end, used once ahead: the first-use costs of matplotlib and of
MLflow's model saving (torch.export's first export over a second of it), paid once a process
on a thread of its own (`RunLogger.warm_up`), beside the fit's first Spark job.

That thread runs while the driver builds `model_fn` under the fit's seed, from torch's global
generator: nothing here may draw from it, or the driver's initial parameters and frozen
weights would no longer be the seed's, and every replica's frozen weights would differ from
the driver's (the fit refused as if `model_fn` were at fault)."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
import threading
from types import ModuleType

import numpy as np

from sparkdl_avg._gc_pause import collector_paused

log = logging.getLogger("sparkdl_avg")
_IMPORTING = threading.Lock()
saved_a_model = False
"""Whether this process has saved a model (`pay`): the first-use costs are paid."""


def pay(logs_model: bool | str) -> None:
    """Pay the first-use costs of what a fit of `logs_model` logs at its end: matplotlib, and
    for a whole model MLflow's model saving, saving a 2-parameter model to a folder then
    removed. Once a process: a later fit's saving would only take CPU from its workers
    (0.3-0.5 s a fit on two busy cores). Only a head start: a failure is logged."""
    try:
        with collector_paused():  # a first fit imports matplotlib and torch.export here
            import_and_save(logs_model)
    except Exception:  # noqa: BLE001 - only a head start
        log.debug("warm-up failed", exc_info=True)


def import_and_save(logs_model: bool | str) -> None:
    """`pay`'s work, raising what fails."""
    global saved_a_model
    from matplotlib.figure import Figure  # noqa: F401

    from sparkdl_avg.tracking import plots  # noqa: F401

    if logs_model is not True or saved_a_model:  # "adapters": files, not a model
        return
    import torch

    mlflow_pytorch = import_mlflow_pytorch()

    model = torch.nn.utils.skip_init(torch.nn.Linear, 2, 1).eval()  # no draw: zeros below
    for param in model.parameters():  # each its own storage, as a model's are (export warns
        torch.nn.init.zeros_(param)  # of parameters that share one)
    folder = tempfile.mkdtemp(prefix="sparkdl-avg-warm-up-")
    try:
        mlflow_pytorch.save_model(model, f"{folder}/model",
                                  input_example=np.zeros((2, 2), np.float32),
                                  pip_requirements=["torch"])
        saved_a_model = True
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def import_mlflow_pytorch() -> ModuleType:
    """`mlflow.pytorch`, without what its import does to the process's logging: its Lightning
    module runs `logging.basicConfig(level=ERROR)`, which raised the root logger to ERROR and
    gave it a handler, so that every WARNING after the first fit (the user's, transformers',
    ours) was silenced. That call does nothing while it imports here; one thread imports at a
    time (the warm-up's and a fit's may both ask)."""
    with _IMPORTING:
        if "mlflow.pytorch" not in sys.modules:
            configure, logging.basicConfig = logging.basicConfig, _no_basic_config
            try:
                import mlflow.pytorch  # noqa: F401
            finally:
                logging.basicConfig = configure
        return sys.modules["mlflow.pytorch"]


def _no_basic_config(**_) -> None:
    """`logging.basicConfig` while MLflow's pytorch flavor imports (`import_mlflow_pytorch`)."""
