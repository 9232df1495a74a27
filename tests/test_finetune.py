"""Fine-tuning (issue 30): only what trains is averaged and sent. A frozen backbone of 4M
parameters (with a BatchNorm in eval mode, whose statistics must stay its own) under a head of
20k: the driver moves at most 1 MB a round, and the backbone ends bit-identical to its build,
over the driver and the collective transport and in async mode. The head's trajectory equals
a fit of the head alone on the backbone's output precomputed as features (float64, SGD,
averaging every step: 1e-10). Replicas whose frozen weights differ are refused before
training, naming the first differing parameter; so is a resume over other frozen weights."""

from __future__ import annotations

import os
import time

import mlflow
import numpy as np
import pytest
import torch
from pyspark.ml.linalg import Vectors, VectorUDT
from pyspark.sql.types import DoubleType, StructField, StructType
from rounding import evaluation_here

from sparkdl_avg import ConfigError, ModelError, TrainConfig, fit
from sparkdl_avg.averaging.flat_buffer import averaged_tensors
from sparkdl_avg.averaging.frozen import frozen_tensors

pytestmark = pytest.mark.spark

IN, WIDE, CLASSES = 64, 2000, 10  # backbone 64*2000 + 2000*2000 (+ BN): 4.13M; head 20k


class Tuned(torch.nn.Module):
    """A frozen backbone, its BatchNorm in eval mode, and a trainable head."""

    def __init__(self, backbone_seed: int | None = None, dtype=torch.float32) -> None:
        super().__init__()
        if backbone_seed is not None:  # frozen weights from elsewhere than the fit's seed
            torch.manual_seed(backbone_seed)
        self.backbone = torch.nn.Sequential(
            torch.nn.Linear(IN, WIDE), torch.nn.ReLU(), torch.nn.Linear(WIDE, WIDE),
            torch.nn.BatchNorm1d(WIDE), torch.nn.Tanh())
        with torch.no_grad():  # statistics that are not the identity: eval mode uses them
            self.backbone[3].running_mean.uniform_(-0.1, 0.1)
            self.backbone[3].running_var.uniform_(0.5, 2.0)
        self.backbone.requires_grad_(False).eval()
        self.head = torch.nn.Linear(WIDE, CLASSES)
        self.to(dtype)

    def forward(self, x):
        return self.head(self.backbone(x))


def _pid_backbone():
    return Tuned(backbone_seed=os.getpid())


def _other_backbone():
    return Tuned(backbone_seed=12345)


def _double():
    return Tuned(dtype=torch.float64)


def _head_only():
    """The same head, as `_double` builds it under the fit's seed."""
    return _double().head


@pytest.fixture(scope="module")
def rows():
    g = np.random.default_rng(3)
    x = g.normal(size=(96, IN))
    y = (x[:, :CLASSES] + 0.1 * g.normal(size=(96, CLASSES))).argmax(1).astype(float)
    return x, y


@pytest.fixture(scope="module")
def frame(spark, rows):
    x, y = rows
    schema = StructType([StructField("features", VectorUDT()),
                         StructField("label", DoubleType())])
    return spark.createDataFrame([(Vectors.dense(a), float(b)) for a, b in zip(x, y, strict=True)],
                                 schema).repartition(2).cache()


def _frozen_state(model):
    return {k: v.clone() for k, v in model.backbone.state_dict().items()}


def _built(model_fn, seed=0):
    torch.manual_seed(seed)
    return model_fn()


SYNC = dict(num_workers=2, epochs=2, batch_size=16, averaging_frequency=2, optimizer="adam",
            lr=0.01, log_model=False, experiment_name="finetune")


@pytest.mark.parametrize("mode", ["driver", "collective", "async"])
def test_a_frozen_backbone_never_travels_and_stays_as_built(frame, rows, mode):
    config = TrainConfig(**SYNC, transport=mode) if mode != "async" else TrainConfig(
        **{k: v for k, v in SYNC.items() if k != "averaging_frequency"}, mode="async",
        push_every=2)
    result = fit(frame, Tuned, config, eval_df=frame)
    built = _frozen_state(_built(Tuned))
    for name, value in _frozen_state(result.model).items():
        assert torch.equal(value, built[name]), name  # BatchNorm statistics included
    params = mlflow.get_run(result.run_id).data.params
    assert int(params["trained_parameters"]) == WIDE * CLASSES + CLASSES
    assert float(params["averaged_mb"]) < 0.1  # a vector a push (async) or all-reduce
    x, y = (torch.from_numpy(a) for a in rows)

    def loss(model):
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model.eval()(x.float()), y.long())

    assert loss(result.model) < loss(_built(Tuned)) - 0.05  # the head learned
    # the workers' own evaluation of the final parameters, on their replicas' backbones
    # (BatchNorm in eval mode, statistics as built), is the driver's on the result: within
    # rounding of sums of 2000 float32 terms (`rounding.evaluation_here`, probably: about
    # 0.03 here, where the BatchNorm on batch statistics moves the loss by 0.11)
    final = [r["eval_loss"] for r in result.history if "eval_loss" in r][-1]
    here, apart, _, _ = evaluation_here(
        torch.nn.Sequential(result.model.backbone, result.model.head), x.float(), y.long(),
        probable=True)
    assert abs(final - here) <= apart, (final, here, apart)
    history = result.history
    if mode != "async":
        # driver: two pushes and two averages of 80 kB; collective: the control plane, and
        # the average when the driver keeps it. The whole model would be 66 MB
        assert max(r["driver_mb"] for r in history if "driver_mb" in r) <= 1.0


@pytest.mark.exact
def test_the_heads_trajectory_is_a_fit_on_precomputed_features(spark, rows):
    x, y = rows
    backbone = _built(_double).backbone
    with torch.no_grad():
        features = backbone(torch.from_numpy(x)).numpy()
    schema = StructType([StructField("features", VectorUDT()),
                         StructField("label", DoubleType())])

    def frame(data):
        pairs = zip(data, y, strict=True)  # rows by position: the same order in both
        return spark.createDataFrame([(Vectors.dense(a), float(b)) for a, b in pairs], schema)

    config = TrainConfig(num_workers=2, epochs=2, batch_size=8, averaging_frequency=1,
                         optimizer="sgd", lr=0.05, shuffle=False, log_model=False,
                         experiment_name="finetune")
    tuned = fit(frame(x), _double, config).model.head
    alone = fit(frame(features), _head_only, config).model
    assert not torch.equal(tuned.weight, _built(_head_only).weight)  # it trained
    for a, b in zip(tuned.parameters(), alone.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-10


def test_replicas_with_other_frozen_weights_are_refused_before_training(frame):
    with pytest.raises(ModelError, match=r"frozen weights.*'backbone\.0\.weight'") as info:
        fit(frame, _pid_backbone, TrainConfig(**SYNC))
    assert "round" not in str(info.value).split("frozen")[0]
    runs = mlflow.search_runs(experiment_names=["finetune"], order_by=["start_time DESC"],
                              max_results=1)
    assert runs.iloc[0]["status"] == "FAILED"
    assert "metrics.train_loss" not in runs.columns or np.isnan(
        runs.iloc[0]["metrics.train_loss"])  # no round was trained


def _built_after_the_warm_up():
    """A frozen layer and a head, built on the driver only once the fit's warm-up (on a thread
    of its own) has made and saved its model: as a slow model_fn's build would span it."""
    from pyspark import TaskContext

    if TaskContext.get() is None:  # the driver (the replicas' builds run in tasks)
        from sparkdl_avg.tracking import first_use

        deadline = time.monotonic() + 60
        while not first_use.saved_a_model and time.monotonic() < deadline:
            time.sleep(0.02)
        assert first_use.saved_a_model, "the fit's warm-up saved no model within 60 s"
    frozen = torch.nn.Linear(IN, 16).requires_grad_(False)
    return torch.nn.Sequential(frozen, torch.nn.ReLU(), torch.nn.Linear(16, CLASSES))


def test_the_warm_up_beside_the_drivers_build_leaves_its_frozen_weights_as_seeded(
        frame, monkeypatch):
    """The driver builds model_fn under the fit's seed while its warm-up saves a model of its
    own on another thread (a process's first fit that logs a model). Had that model drawn its
    weights from torch's global generator, the driver's frozen weights would differ from
    every replica's, and the fit would be refused as if model_fn were at fault."""
    from sparkdl_avg.tracking import first_use

    monkeypatch.setattr(first_use, "saved_a_model", False)  # this process's first model saving
    result = fit(frame, _built_after_the_warm_up,
                 TrainConfig(**{**SYNC, "epochs": 1, "log_model": True}))
    seeded = _built(_built_after_the_warm_up)
    assert torch.equal(result.model[0].weight, seeded[0].weight)
    assert torch.equal(result.model[0].bias, seeded[0].bias)


def test_a_resume_over_other_frozen_weights_is_refused(frame, tmp_path):
    config = TrainConfig(**SYNC, checkpoint_every=1, checkpoint_dir=str(tmp_path))
    first = fit(frame, Tuned, config)
    longer = TrainConfig(**{**SYNC, "epochs": 3})
    with pytest.raises(ConfigError, match=r"frozen weights.*'backbone\.0\.weight'"):
        fit(frame, _other_backbone, longer, resume_from=str(tmp_path))
    resumed = fit(frame, Tuned, longer, resume_from=str(tmp_path))  # the same ones: resumes
    params = mlflow.get_run(resumed.run_id).data.params
    assert params["resumed_at_round"] == str(len(first.history))


BUILDS: list[str] = []
"""Where the driver built `_recorded` (the default device of the moment)."""


def _recorded():
    BUILDS.append(torch.empty(0).device.type)
    return Tuned()


def test_a_meta_driver_holds_no_frozen_weights_and_trains_the_same(frame):
    full = fit(frame, Tuned, TrainConfig(**SYNC))
    BUILDS.clear()
    meta = fit(frame, _recorded, TrainConfig(**SYNC, driver_model="meta"))
    assert BUILDS == ["meta"]  # the replicas and the initial state: built on executors
    held = meta._model.__self__.model  # the plan's model: what the driver held in the fit
    assert all(t.is_meta for _, t in frozen_tensors(held))
    assert not any(t.is_meta for t in averaged_tensors(held))
    model = meta.model  # assembled now: model_fn on the driver, the trained state copied in
    assert BUILDS == ["meta", "cpu"] and meta.model is model and not model.training
    for (name, a), b in zip(full.model.state_dict().items(), model.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
