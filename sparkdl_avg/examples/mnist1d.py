"""MNIST-1D (Greydanus & Kobak, 2020): generated offline, cached as Parquet, read by Spark.

`mnist1d.data.make_dataset` builds the data locally from templates; `get_dataset` downloads
and is never used here. Generation takes ~40 s per 100,000 samples, so it is cached.
"""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path

import torch

NUM_FEATURES, NUM_CLASSES = 40, 10


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return Path(root) / "sparkdl_avg"


def tables(num_samples: int, seed: int) -> dict:
    """{"train": pa.Table, "test": pa.Table} with features list<float> and label int64."""
    import numpy as np
    import pyarrow as pa
    from mnist1d.data import get_dataset_args, make_dataset

    args = get_dataset_args()
    args.num_samples, args.seed = num_samples, seed
    data = make_dataset(args)
    out = {}
    for name, x, y in (("train", data["x"], data["y"]), ("test", data["x_test"], data["y_test"])):
        x = np.ascontiguousarray(x, dtype=np.float32)
        features = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), x.shape[1])
        out[name] = pa.table({"features": features.cast(pa.list_(pa.float32())),
                              "label": pa.array(y.astype(np.int64))})
    return out


def write_parquet(num_samples: int, seed: int, cache_dir: str | os.PathLike | None) -> Path:
    """Generate once and return the folder holding train.parquet and test.parquet."""
    folder = Path(cache_dir or default_cache_dir()) / f"mnist1d-{num_samples}-seed{seed}"
    if (folder / "test.parquet").exists():
        return folder
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    for name, table in tables(num_samples, seed).items():
        tmp = folder / f".{name}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.replace(folder / f"{name}.parquet")  # atomic: no half-written cache
    return folder


def generate(spark, num_samples: int = 5_000, seed: int = 42):
    """(train_df, test_df) built in memory on the driver and handed to Spark through Arrow:
    no shared filesystem needed (a notebook on a cluster)."""
    made = tables(num_samples, seed)
    return spark.createDataFrame(made["train"]), spark.createDataFrame(made["test"])


def load(spark, num_samples: int = 20_000, seed: int = 42, cache_dir=None):
    """(train_df, test_df) with columns features array<float> and label long; 80/20 split."""
    folder = write_parquet(num_samples, seed, cache_dir)
    return (spark.read.parquet(str(folder / "train.parquet")),
            spark.read.parquet(str(folder / "test.parquet")))


def _build_mlp(hidden: tuple[int, ...], num_features: int, num_classes: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    width = num_features
    for h in hidden:
        layers += [torch.nn.Linear(width, h), torch.nn.ReLU()]
        width = h
    layers.append(torch.nn.Linear(width, num_classes))
    return torch.nn.Sequential(*layers)


def mlp(hidden: tuple[int, ...] = (1024, 1024), num_features: int = NUM_FEATURES,
        num_classes: int = NUM_CLASSES):
    """A picklable zero-argument model factory for `fit(model_fn=...)`."""
    return partial(_build_mlp, tuple(hidden), num_features, num_classes)
