"""Scoring a DataFrame with a trained model on the executors, batched through Arrow.

`predict_udf` is an iterator Arrow UDF: each task unpickles the model once, puts it on the GPU
Spark gave the task (else the CPU), and turns each Arrow batch of feature arrays into one
tensor without a Python loop over rows."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator

import pyarrow as pa
import torch

from sparkdl_avg._errors import ConfigError, DataError
from sparkdl_avg._model import pickle_for_executors


def make_predict_udf(model: torch.nn.Module, *, num_features: int, classify: bool,
                     device: str = "auto", batch_size: int = 8192,
                     features: str = "the features column") -> Callable:
    """A column function: features (array<float|double>) -> the class index (classifier),
    the value (one output) or array<double> (several outputs). A batch with a null, NaN or
    infinite feature fails the task with a DataError naming `features` (the column)."""
    try:
        from pyspark.sql.functions import arrow_udf
    except ImportError:
        raise ConfigError("scoring needs pyspark 4.1 or newer (its arrow_udf); this is "
                          "pyspark " + __import__("pyspark").__version__) from None
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda'")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size must be a positive integer, got {batch_size!r}")
    model = copy.deepcopy(model).cpu().eval()  # the caller's model stays where it is
    with torch.no_grad():
        probe = model(torch.zeros(1, num_features, dtype=_dtype(model)))
    width = probe.reshape(1, -1).shape[1]
    return_type = "long" if classify else ("double" if width == 1 else "array<double>")
    payload = pickle_for_executors("model", model)

    def predict(batches: Iterator[pa.Array]) -> Iterator[pa.Array]:
        try:
            yield from _predict_batches(payload, batches, num_features=num_features,
                                        classify=classify, width=width, device=device,
                                        batch_size=batch_size, features=features)
        finally:
            _release_gpu()

    return arrow_udf(predict, return_type)


def _predict_batches(payload: bytes, batches: Iterator, *, num_features: int, classify: bool,
                     width: int, device: str, batch_size: int,
                     features: str = "the features column") -> Iterator:
    import cloudpickle
    import numpy as np

    from sparkdl_avg.task.device import task_device

    target = torch.device(task_device(device).device)
    if target.type == "cuda":  # as training does: model code that says .cuda() lands here
        torch.cuda.set_device(target)
    model = cloudpickle.loads(payload).to(target).eval()
    dtype = _dtype(model)
    with torch.no_grad():
        for column in batches:
            values = column.flatten()
            if column.null_count or values.null_count:
                raise DataError(f"{features} holds nulls ({column.null_count} null rows, "
                                f"{values.null_count} null values): cannot score them")
            lengths = column.value_lengths().to_numpy(zero_copy_only=False)
            if len(lengths) and (lengths.min() != num_features or lengths.max() != num_features):
                raise ValueError(f"features must have {num_features} values per row, got "
                                 f"{int(lengths.min())} to {int(lengths.max())}")
            x = torch.from_numpy(np.ascontiguousarray(values.to_numpy(zero_copy_only=False))
                                 .reshape(-1, num_features))
            _check_finite(x, features)
            chunks = x.split(batch_size) if len(x) else [x]  # rows per forward: batch_size
            out = torch.cat([model(_on(chunk, target).to(dtype)) for chunk in chunks])
            if classify:
                yield pa.array(out.argmax(dim=1).cpu().numpy().astype(np.int64))
            elif width == 1:
                yield pa.array(out.reshape(-1).double().cpu().numpy())
            else:
                flat = out.reshape(-1, width).double().cpu().numpy()
                yield pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), width) \
                    .cast(pa.list_(pa.float64()))


def _release_gpu() -> None:
    """Once a task has scored (the model gone with `_predict_batches`' frame): Spark reuses
    the Python worker, and CUDA's cache of the model's and the batches' blocks would hold
    the GPU's memory into the next fit, whose free-memory check would then fail."""
    if torch.cuda.is_initialized():
        from sparkdl_avg.task.memory import release_task_memory

        release_task_memory()


def _check_finite(x: torch.Tensor, features: str) -> None:
    """NaN or an infinity would be scored as any other value (a classifier's argmax returns
    a class for it): refused, as training's validation refuses them."""
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        rows = int((~finite.all(dim=1)).sum())
        raise DataError(f"{features} holds NaN or infinite values in {rows} of {len(x)} rows "
                        "of a batch: cannot score them; drop or impute those rows first")


def _on(x: torch.Tensor, target: torch.device) -> torch.Tensor:
    return x.pin_memory().to(target, non_blocking=True) if target.type == "cuda" else x


def _dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        return p.dtype
    return torch.float32
