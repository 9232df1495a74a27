"""Pins the trajectory of a small sync fit across refactors, in numbers every CPU reproduces.

The fit: Adam, dropout, optimizer state averaging and shuffling, 2 workers, in float64. Its
final parameters are pinned as each tensor's sum and norm (`PINNED`, recorded with torch
2.13.0 on the CPU) and compared within `BOUND`. A stored hash of the bytes would not do: the
same torch build takes other kernels on another CPU (`torch.backends.cpu.get_cpu_capability`,
MKL's own dispatch), which round differently. A fit restarted after a task failure must land
on the very bytes of the uninterrupted fit of the same session: the same kernels on the same
machine. Change `PINNED` only in a commit that says why the trajectory changed."""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from faulty import N_FEATURES, FaultyMLP, assert_sync_recovery, same_parameters

from sparkdl_avg import TrainConfig, fit

pytestmark = [pytest.mark.spark, pytest.mark.exact]

PINNED_TORCH = "2.13.0"
PINNED = {  # (sum, norm) of each final tensor
    "net.0.bias": (1.4427179641150893, 1.5957656627723984),
    "net.0.weight": (0.7804511785172349, 3.4560058285323563),
    "net.3.bias": (0.15939376827662075, 0.17387399872919942),
    "net.3.weight": (-1.4625374710983112, 1.7898810983143527),
}
BOUND = 1e-12
"""Enough for any CPU: another kernel path (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE)
moved the final parameters by at most 3.1e-16 here, and a 1-ulp change of every initial
weight by at most 4.4e-16: this trajectory damps rounding rather than amplifying it, so 1e-12
is over 2000 times what rounding does. Tight enough for a real change: lr 0.0101 for 0.01
moved the numbers by 8e-3 or more, no shuffling, averaging every 3 steps, a seed of 12 or no
optimizer state averaging by 0.04 to 0.25."""
CONFIG = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2, optimizer="adam",
              lr=0.01, seed=11, average_optimizer_state=True, checkpoint_every=3,
              log_model=False, experiment_name="pinned")


class PortableDropout(torch.nn.Module):
    """Dropout whose mask every CPU draws alike: torch.rand comes from torch's own generator
    everywhere, where nn.Dropout's bernoulli_ draws from MKL's generator on Intel CPUs and
    from torch's on others (ATen's bernoulli_scalar_kernel), so its masks differ by vendor."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return x
        return x * (torch.rand(x.shape, dtype=x.dtype) >= self.p) / (1 - self.p)


class PinnedMLP(FaultyMLP):
    """FaultyMLP (its faults for the restart) in float64, with `PortableDropout` and initial
    weights every CPU draws alike: nn.Linear's own initialisation (uniform_ from -b to b) is
    rounded differently by the AVX2 kernel (fused multiply-add) than by the default one;
    torch.rand's [0, 1) is exact on both, and the scaling after it is IEEE arithmetic."""

    def __init__(self, **faults) -> None:
        super().__init__(**faults)
        self.net[2] = PortableDropout(0.2)
        self.double()
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for layer in (self.net[0], self.net[3]):
                bound = 1 / math.sqrt(layer.in_features)  # nn.Linear's own range
                for p in (layer.weight, layer.bias):
                    p.copy_((torch.rand(p.shape, generator=generator, dtype=torch.float64)
                             * 2 - 1) * bound)


def pinned_numbers(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    return {name: (t.sum().item(), t.norm().item())
            for name, t in sorted(model.state_dict().items())}


@pytest.fixture(autouse=True)
def _pinned_torch():
    if torch.__version__.split("+")[0] != PINNED_TORCH:
        pytest.skip(f"the numbers belong to torch {PINNED_TORCH} on the CPU")


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(3)
    x = rng.normal(size=(600, N_FEATURES))  # float64, as the model
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y})).cache()


@pytest.fixture(scope="module")
def uninterrupted(data):
    return fit(data, PinnedMLP, TrainConfig(**CONFIG))


def test_sync_fit_lands_on_the_recorded_parameters(uninterrupted):
    got = pinned_numbers(uninterrupted.model)
    assert got.keys() == PINNED.keys()
    assert all(abs(g - p) <= BOUND for name in PINNED
               for g, p in zip(got[name], PINNED[name], strict=True)), got


def test_restarted_sync_fit_lands_on_the_uninterrupted_ones_bytes(data, uninterrupted,
                                                                   tmp_path):
    model_fn = partial(PinnedMLP, fault="raise", marker=str(tmp_path / "fired"),
                       steps_dir=str(tmp_path))
    result = fit(data, model_fn, TrainConfig(**CONFIG))
    assert (tmp_path / "fired").exists() and len(result.failures) == 1
    assert_sync_recovery(result, tmp_path, at_call=9, steps_per_round=2, total_steps=40)
    assert same_parameters(result.model, uninterrupted.model)
