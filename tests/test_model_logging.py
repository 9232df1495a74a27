"""Logging a fit's model to MLflow, without a fit: quiet (no warning, nothing on stderr), one
export, nothing downloaded back; issue 39 saw a small GRU print torch.export's
`_flat_weights` warning."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

import sparkdl_avg
from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.tracking import model as tracking_model

STEPS = 6
"""The sequence's length: torch.export's cost grows with it for an RNN."""
SCHEMA = DataSchema(inputs=(FieldSpec(role="input", name="x", column="x", wire="_x",
                                      dtype="float32", shape=(STEPS,), source="array<float>"),),
                    binding="single", labels=(), label_list=False)


class SequenceClassifier(torch.nn.Module):
    """A row of STEPS floats read as a sequence by a recurrent layer; 3 class logits."""

    def __init__(self, rnn: type[torch.nn.RNNBase]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.rnn, self.out = rnn(1, 8, batch_first=True), torch.nn.Linear(8, 3)

    def forward(self, x):
        hidden, _ = self.rnn(x.unsqueeze(-1))
        return self.out(hidden[:, -1])


@pytest.mark.parametrize("rnn", [torch.nn.GRU, torch.nn.LSTM], ids=["gru", "lstm"])
def test_logging_a_recurrent_model_is_quiet_and_it_scores(rnn, capfd, monkeypatch):
    """No Python warning and nothing on stderr (MLflow's progress bars go there), one
    torch.export call and no artifact downloaded while logging; the logged pyfunc scores as
    the module does, so the ignored warning lost nothing."""
    from mlflow.store.artifact.artifact_repo import ArtifactRepository

    exports, downloads = [], []
    export = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: exports.append(1) or
                        export(*a, **k))
    download = ArtifactRepository.download_artifacts
    monkeypatch.setattr(ArtifactRepository, "download_artifacts",
                        lambda self, *a, **k: downloads.append(a) or download(self, *a, **k))
    model = SequenceClassifier(rnn).eval()
    mlflow.set_experiment("model-logging")
    capfd.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mlflow.start_run() as run:
            tracking_model.log_model(model, schema=SCHEMA, heads=("class",),
                                     pip_requirements=["torch"])
    assert [str(w.message) for w in caught] == []
    assert capfd.readouterr().err == ""
    assert (len(exports), downloads) == (1, [])
    rows = np.random.default_rng(0).normal(size=(5, STEPS)).astype(np.float32)
    scored = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model").predict(
        pd.DataFrame({"x": list(rows)}), params={"output": "raw"})
    with torch.no_grad():
        expected = model(torch.from_numpy(rows)).numpy()
    np.testing.assert_allclose(np.stack(scored), expected, rtol=1e-5, atol=1e-6)


def test_only_the_rnn_weights_warning_is_ignored():
    """The filter names the RNN's cache alone: export's warning about any other attribute
    (a real tensor kept outside the module's parameters and buffers) still shows."""
    messages = ["The tensor attributes self.gru._flat_weights[0], self.gru._flat_weights[1] "
                "were assigned during export.",
                "The tensor attribute self.cache was assigned during export.",
                "The tensor attributes self.rnn._flat_weights[0], self.cache were assigned "
                "during export."]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracking_model._quiet_rnn_export()  # put first, as each export does
        for message in messages:
            warnings.warn(message, UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == messages[1:]


def test_importing_mlflows_pytorch_flavor_leaves_the_processs_logging_as_it_was():
    """mlflow.pytorch's import runs `logging.basicConfig(level=ERROR)` (its Lightning
    module): every WARNING after a fit's first model log went unseen, the user's and ours.
    In a fresh interpreter, where nothing imported it yet; and nothing else imports it."""
    code = ("import logging, sys\n"
            "from sparkdl_avg.tracking.first_use import import_mlflow_pytorch\n"
            "assert 'mlflow.pytorch' not in sys.modules\n"
            "import_mlflow_pytorch()\n"
            "root = logging.getLogger()\n"
            "print(root.level, len(root.handlers))\n"
            "logging.getLogger('myapp').warning('still heard')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(logging.WARNING), "0"]
    assert "still heard" in done.stderr
    package = Path(sparkdl_avg.__file__).parent
    importers = [str(p.relative_to(package)) for p in package.rglob("*.py")
                 if re.search(r"^\s*(import mlflow\.pytorch|from mlflow\.pytorch|from mlflow "
                              r"import pytorch)", p.read_text(), re.M)]
    assert importers == ["tracking/first_use.py"], importers
