"""A channels_last CNN trained with the fused Adam step survives a restart and a resume
bit-identically: its optimizer state comes back in its parameters' memory format (issue 28).
Restored contiguous, the fused step mixed up the moments' elements after every restore."""

from __future__ import annotations

from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from faulty import FaultyMLP, same_parameters

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark

SHAPE = (3, 4, 4)
"""Channels, height, width of an image; the features are its pixels."""
BASE = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2, optimizer="adam",
            experiment_name="channels_last", lr=0.01, seed=5, checkpoint_every=3,
            log_model=False)
"""240 rows: 8 steps an epoch a worker, 8 rounds in 2 epochs, a checkpoint after rounds 2, 5
and 7."""


class FaultyCNN(FaultyMLP):
    """FaultyMLP's faults over a small conv net kept channels_last, as docs/guide/faults.md
    advises."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(
            torch.nn.Unflatten(1, SHAPE), torch.nn.Conv2d(SHAPE[0], 4, 3), torch.nn.ReLU(),
            torch.nn.Flatten(), torch.nn.Linear(4 * 2 * 2, 3),
        ).to(memory_format=torch.channels_last)


@pytest.fixture(scope="module")
def images(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(240, int(np.prod(SHAPE)))).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 17] > 0.3).astype(np.int64)
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y})).cache()


@pytest.fixture(scope="module")
def straight(images):
    """The fit without a fault or a pause."""
    return fit(images, FaultyCNN, TrainConfig(**BASE))


def test_a_channels_last_cnn_restarts_bit_identically(images, straight, tmp_path):
    assert FaultyCNN().net[1].weight.is_contiguous(memory_format=torch.channels_last)
    model_fn = partial(FaultyCNN, fault="raise", marker=str(tmp_path / "fired"), at_call=9)
    result = fit(images, model_fn, TrainConfig(**BASE))
    assert (tmp_path / "fired").exists()
    [failure] = result.failures
    # the 9th step is round 4 of 8: the restart from round 3's point redoes rounds 3 and 4
    # with the restored Adam state, and rounds 5 to 7 follow
    assert failure["restart_at"] == "round 3" and len(straight.history) == 8
    assert same_parameters(result.model, straight.model)


def test_a_channels_last_cnn_resumes_bit_identically(images, straight, tmp_path):
    folder = str(tmp_path / "ckpt")
    fit(images, FaultyCNN, TrainConfig(**{**BASE, "epochs": 1}, checkpoint_dir=folder))
    resumed = fit(images, FaultyCNN, TrainConfig(**BASE, checkpoint_dir=folder),
                  resume_from=folder)
    assert resumed.history[0]["round"] == 1 and len(resumed.history) == 8
    assert same_parameters(resumed.model, straight.model)
