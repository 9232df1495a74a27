"""The model saved ahead (`tracking.model_ahead`): exported from its initial values while the
fit trains, then logged with the trained values and no export; where the export kept
something training changed, the model is exported afresh. No Spark, but a fit at the end:
the end of a real fit exports nothing on its own thread."""

from __future__ import annotations

import logging
import os
import threading

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.tracking import model as tracking_model
from sparkdl_avg.tracking.model_ahead import SavedAhead

STEPS = 6
SCHEMA = DataSchema(inputs=(FieldSpec(role="input", name="x", column="x", wire="_x",
                                      dtype="float32", shape=(STEPS,), source="array<float>"),),
                    binding="single", labels=(), label_list=False)
ROWS = np.random.default_rng(0).normal(size=(5, STEPS)).astype(np.float32)


class Gru(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.out = torch.nn.GRU(1, 8, batch_first=True), torch.nn.Linear(8, 3)
        self.norm = torch.nn.BatchNorm1d(3)  # buffers that training changes too

    def forward(self, x):
        return self.norm(self.out(self.rnn(x.unsqueeze(-1))[0][:, -1]))


class Shifted(Gru):
    """A tensor kept outside the parameters and buffers, which torch.export bakes into the
    program as a constant: a change to it after the export is not in the saving ahead."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = torch.zeros(3)

    def forward(self, x):
        return super().forward(x) + self.shift


def train_a_little(model: torch.nn.Module) -> None:
    """Change every parameter and BatchNorm's statistics, as rounds of training would."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        model(torch.from_numpy(ROWS)).pow(2).mean().backward()
        optimizer.step()


@pytest.fixture
def exports(monkeypatch) -> list[str]:
    """The name of the thread of every torch.export call."""
    calls: list[str] = []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(
        threading.current_thread().name) or export(*a, **k))
    return calls


def saved_ahead(model: torch.nn.Module) -> SavedAhead:
    ahead = SavedAhead(model, schema=SCHEMA, heads=("class",), pip_requirements=["torch"])
    ahead.save()
    assert ahead.wait(0)
    return ahead


def log_and_score(model: torch.nn.Module, ahead: SavedAhead) -> np.ndarray:
    mlflow.set_experiment("model-ahead")
    with mlflow.start_run() as run:
        tracking_model.log_model(model, schema=SCHEMA, heads=("class",),
                                 pip_requirements=["torch"], ahead=ahead)
    scored = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model").predict(
        pd.DataFrame({"x": list(ROWS)}), params={"output": "raw"})
    return np.stack(scored)


def module_outputs(model: torch.nn.Module) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(ROWS)).numpy()


def test_the_trained_values_go_into_the_export_made_before_training(exports):
    model = Gru()
    ahead = saved_ahead(model)
    initial = module_outputs(model)
    assert len(exports) == 1
    train_a_little(model)
    trained = module_outputs(model)
    assert np.abs(trained - initial).max() > 0.1  # training changed what the model outputs
    scored = log_and_score(model, ahead)
    assert len(exports) == 1  # logging the trained model traced nothing
    # the same float32 graph as the module's, decomposed: a few float32 roundings apart
    np.testing.assert_allclose(scored, trained, rtol=1e-5, atol=1e-5)
    ahead.close()


def test_a_value_the_export_baked_in_is_exported_afresh(exports, caplog):
    caplog.set_level(logging.DEBUG, logger="sparkdl_avg")
    model = Shifted()
    ahead = saved_ahead(model)
    train_a_little(model)
    model.shift += 3.0  # not in any state the program takes values into
    scored = log_and_score(model, ahead)
    assert len(exports) == 2  # the saving ahead's, then the fresh one
    assert "the program differs from the trained module" in caplog.text
    np.testing.assert_allclose(scored, module_outputs(model), rtol=1e-5, atol=1e-5)
    ahead.close()


def test_another_structure_is_exported_afresh(exports, caplog):
    caplog.set_level(logging.DEBUG, logger="sparkdl_avg")
    ahead = saved_ahead(Gru())
    other = Gru()
    other.out = torch.nn.Linear(8, 3, bias=False)  # a state the saving ahead lacks a value of
    scored = log_and_score(other, ahead)
    assert len(exports) == 2
    assert "the program's state is not the trained module's" in caplog.text
    np.testing.assert_allclose(scored, module_outputs(other), rtol=1e-5, atol=1e-5)
    ahead.close()


def test_a_closed_saving_leaves_nothing(tmp_path, exports):
    ahead = SavedAhead(Gru(), schema=SCHEMA, heads=("class",), pip_requirements=["torch"])
    ahead.close()  # the fit ended before the thread began: it saves nothing, and leaves no folder
    ahead.save()
    assert exports == [] and not os.path.exists(os.path.dirname(ahead.path))
    assert not ahead.save_trained(str(tmp_path / "model"), None, Gru())
