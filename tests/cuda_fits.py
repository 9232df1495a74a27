"""Run by test_cuda in its own process, as the driver of an application on a standalone
cluster whose workers each report the machine's real GPU 0. Writes what the fits did as JSON.

`fits`: the training stage takes its GPU through the fit's stage-level resource profile.
  - float64 SGD with momentum on the GPU, against large-batch SGD on the CPU;
  - a float32 Adam fit with `deterministic=True`, twice from the memory cache and once from
    the disk cache (pinned slices, side-stream copies): bit-identical or not;
  - fp16 (gradient scaler) and bf16 autocast fits, and an async fit, each on the GPU;
  - two tasks handed the same GPU: the refusal.
`scoring`: `spark.task.resource.gpu.amount=1`, so every task holds the GPU; a fit, then
  `transform` whose tasks record the device their inputs were on.

    python tests/cuda_fits.py OUT.json spark://127.0.0.1:7077 fits|scoring [cuda|cpu]

(`cpu` runs the same script on a machine without CUDA, to check the script itself.)
"""

import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from pyspark.sql import SparkSession
from test_fit_sync import (
    N_CLASSES,
    N_FEATURES,
    make_data,
    max_param_diff,
    reference_large_batch_sgd,
)

from sparkdl_avg import TrainConfig, fit


def make_model_f64() -> torch.nn.Module:
    torch.manual_seed(123)
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, N_CLASSES)).double()


def make_model_f32() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, N_CLASSES))


class RecordsDevice(torch.nn.Linear):
    """Linear(6, 1) that, when scoring in a Spark task, appends the device of its input to
    `folder`/devices (the driver's own check of the model's output runs on its CPU)."""

    def __init__(self, folder: str = "") -> None:
        super().__init__(N_FEATURES, 1)
        self.folder = folder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        if self.folder and not self.training and TaskContext.get() is not None:
            with open(os.path.join(self.folder, "devices"), "a") as f:
                f.write(f"{x.device}\n")
        return super().forward(x)


def frame(spark, x, y):
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y}))


def identical(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(pa, pb)
               for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


def losses(result) -> list[float]:
    return [h["train_loss"] for h in result.history if "train_loss" in h]


def run_fits(spark, device: str) -> dict:
    out: dict = {}
    x, y = make_data(411)
    cfg = TrainConfig(num_workers=1, epochs=2, batch_size=8, averaging_frequency=1,
                      optimizer="sgd", lr=0.05, momentum=0.9, shuffle=False, seed=7,
                      log_model=False, device=device, deterministic=True,
                      experiment_name="cuda")
    result = fit(frame(spark, x, y), make_model_f64, cfg)
    # the reference builds test_fit_sync's make_model_f64: the same layers and seed as here
    out["float64"] = {"diff": max_param_diff(result.model, reference_large_batch_sgd(
        x, y, 8, 2, 0.05, 0.9)), "moved": max_param_diff(result.model, make_model_f64()),
        "rounds": len(result.history), "workers": result.workers}

    x, y = make_data(4000, seed=1)
    df = frame(spark, x.astype(np.float32), y).cache()
    cfg = TrainConfig(num_workers=1, epochs=3, batch_size=32, averaging_frequency=4,
                      optimizer="adam", lr=1e-2, seed=3, deterministic=True, device=device,
                      data_cache="memory", log_model=False, experiment_name="cuda")
    a, b = fit(df, make_model_f32, cfg), fit(df, make_model_f32, cfg)
    disk = fit(df, make_model_f32, dataclasses.replace(cfg, data_cache="disk"))
    out["deterministic"] = {"repeat_identical": identical(a.model, b.model),
                            "disk_identical": identical(a.model, disk.model),
                            "losses": losses(a), "workers": disk.workers}

    for precision in ("bf16", "fp16"):
        if precision == "fp16" and device == "cpu":
            continue  # fp16 needs CUDA (a ConfigError on the CPU)
        r = fit(df, make_model_f32, dataclasses.replace(cfg, precision=precision,
                                                        deterministic=False))
        out[precision] = {"losses": losses(r), "workers": r.workers}

    r = fit(df, make_model_f32, dataclasses.replace(cfg, mode="async", deterministic=False,
                                                    averaging_frequency=8, push_every=4,
                                                    eval_interval_s=0.5))
    out["async"] = {"losses": losses(r), "workers": r.workers}

    try:
        fit(df, make_model_f32, dataclasses.replace(cfg, num_workers=2))
        out["shared_gpu"] = None
    except Exception as exc:  # noqa: BLE001 - the test reads what it was
        out["shared_gpu"] = f"{type(exc).__name__}: {exc}"
    return out


def run_scoring(spark, device: str) -> dict:
    folder = tempfile.mkdtemp()
    x, _ = make_data(2000, seed=2)
    target = (x @ np.arange(1, N_FEATURES + 1) / 10).astype(np.float32)
    df = spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in
                                                          x.astype(np.float32)],
                                             "label": target}))
    cfg = TrainConfig(num_workers=1, epochs=2, batch_size=32, optimizer="adam", lr=1e-2,
                      device=device, log_model=False, experiment_name="cuda")
    result = fit(df, lambda: RecordsDevice(folder), cfg, loss="mse")
    Path(folder, "devices").unlink(missing_ok=True)  # from training, if it evaluated
    scored = result.transform(df.repartition(2)).toPandas()
    features = np.stack(scored["features"].to_numpy()).astype(np.float32)
    result.model.folder = ""
    with torch.no_grad():
        local = result.model(torch.from_numpy(features)).squeeze(1).numpy()
    with open(os.path.join(folder, "devices")) as f:
        devices = f.read().split()
    return {"max_abs_diff": float(np.abs(scored["prediction"].to_numpy() - local).max()),
            "rows": len(scored), "devices": sorted(set(devices)), "workers": result.workers}


def main(out_path: str, master: str, what: str, device: str = "cuda") -> None:
    builder = (SparkSession.builder.master(master)
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1")
               .config("spark.executor.cores", "1")
               .config("spark.executor.memory", "2g")
               .config("spark.executor.resource.gpu.amount", "1"))
    if what == "scoring":
        builder = builder.config("spark.task.resource.gpu.amount", "1")
    spark = builder.getOrCreate()
    try:
        found = run_fits(spark, device) if what == "fits" else run_scoring(spark, device)
        found["torch"] = torch.__version__
        found["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        with open(out_path, "w") as f:
            json.dump(found, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
