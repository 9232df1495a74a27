"""Typed inputs through every way a fit can run (issue 29): int ids, a float vector and a
ragged token column, bound by name, weighted, in float64 on 2 workers, train the same from
memory and from disk (bit-identical), over the collective transport, in async lockstep
(both to 1e-12 of the sync fit), and after a task failure mid-fit (bit-identical)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from faulty import same_parameters
from test_typed_fits import BY_NAME, Recommender, ratings  # noqa: F401 - the fixture

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark

COMMON = dict(num_workers=2, epochs=3, batch_size=8, optimizer="sgd", lr=0.1, momentum=0.9,
              shuffle=True, seed=4, log_model=False, experiment_name="typed-modes")
SYNC = dict(COMMON, averaging_frequency=2)


def _model(**kwargs):
    return Recommender(dtype=torch.float64, **kwargs)


class FailsOnce(Recommender):
    """Raises once, on partition 1 at its 7th training step (round 4 of 9)."""

    def __init__(self, marker: str) -> None:
        super().__init__(dtype=torch.float64)
        self.marker, self.calls = marker, 0

    def forward(self, user, item, dense, tokens):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and self.training:
            self.calls += 1
            if self.calls == 7 and ctx.partitionId() == 1 and not os.path.exists(self.marker):
                open(self.marker, "w").close()  # once: the restarted task trains on
                raise ValueError("injected failure in forward")
        return super().forward(user, item, dense, tokens)


def _fit(df, model_fn=_model, **fields):
    return fit(df, model_fn, TrainConfig(**{**SYNC, **fields}), inputs=BY_NAME,
               weight_col="weight", eval_df=df)


@pytest.fixture(scope="module")
def baseline(ratings):  # noqa: F811
    return _fit(ratings)


def _max_diff(a, b) -> float:
    return max((pa - pb).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.exact
def test_from_disk_bit_identical_to_memory(ratings, baseline):  # noqa: F811
    on_disk = _fit(ratings, data_cache="disk")
    assert {w["cache"] for w in on_disk.workers} == {"disk"}
    assert same_parameters(on_disk.model, baseline.model)
    assert _max_diff(baseline.model, _model()) > 1e-2  # it trained


@pytest.mark.exact
def test_over_the_collective_transport(ratings, baseline):  # noqa: F811
    collective = _fit(ratings, transport="collective")
    assert _max_diff(collective.model, baseline.model) < 1e-12


@pytest.mark.exact
def test_in_async_lockstep(ratings, baseline):  # noqa: F811
    lockstep = fit(ratings, _model, TrainConfig(**COMMON, mode="async", push_every=2,
                                                staleness_bound=0),
                   inputs=BY_NAME, weight_col="weight")
    assert _max_diff(lockstep.model, baseline.model) < 1e-10


def test_a_failure_mid_fit_restarts_bit_identically(ratings, baseline, tmp_path):  # noqa: F811
    marker = str(tmp_path / "fired")
    result = _fit(ratings, partial(FailsOnce, marker), checkpoint_every=1)
    assert os.path.exists(marker) and len(result.failures) == 1
    assert result.failures[0]["restart_at"] == "round 3"
    assert same_parameters(result.model, baseline.model)
