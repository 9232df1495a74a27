"""The logged model of a fit whose preprocess pads each batch to its longest row (a
tokenizer's padding, issue 31): its pt2 export takes the returned rows' dimensions dynamic,
so the pyfunc scores batches of other lengths than the sample's, as `transform` does. The
model sums the tokens' embeddings with a zero pad embedding, so padding changes nothing and
each row's class is the same whatever the longest row of its batch. A model whose export
torch.export fixes at the sample's length though the model takes others (code branching on a
length) is logged pickled instead, with a warning saying why, and scores both lengths."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from rounding import classes_agree, gamma, linear_magnitude

from sparkdl_avg import TrainConfig, fit

VOCAB, ROWS = 10, 24


def _pad(batch, *, training, rng):
    """Token ids (a ragged column: a list of arrays) padded with 0 to the batch's longest."""
    rows = batch["tokens"]
    out = np.zeros((len(rows), max(len(r) for r in rows)), np.int64)
    for i, row in enumerate(rows):
        out[i, :len(row)] = row
    return {"tokens": out}


class BagOfTokens(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, tokens):
        return self.head(self.embed(tokens).sum(1))


def bag_logits(model: BagOfTokens, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logits alone (no padding), and how far another computation (other padded
    lengths, other kernels) may lie from them: the sum of up to 7 embeddings rounds within
    gamma_7 of their magnitudes, carried through the head's |W|, which adds gamma_9 of its
    own terms (`rounding.forward_tolerance`'s reasoning)."""
    with torch.no_grad():
        logits = torch.cat([model(torch.tensor([list(r)])) for r in rows])
        terms = torch.cat([model.embed(torch.tensor([list(r)])).abs().sum(1) for r in rows])
        w = model.head.weight.double().abs()
        error = gamma(torch.float32, 7) * terms.double() @ w.T + \
            gamma(torch.float32, 9) * linear_magnitude(model.head, terms)
    return logits, 2 * error


@pytest.fixture(scope="module")
def fitted(spark):
    rng = np.random.default_rng(4)
    lengths = [5, 2, 3, 4] + rng.integers(1, 8, ROWS - 4).tolist()  # the sample's longest: 5
    rows = [(rng.integers(1, VOCAB, n).tolist(), int(rng.integers(0, 2))) for n in lengths]
    df = spark.createDataFrame(rows, "tokens array<int>, label long")
    config = TrainConfig(num_workers=2, epochs=2, batch_size=4, lr=0.5, seed=1,
                         experiment_name="preprocess-export")
    return df, fit(df, BagOfTokens, config, features_col="tokens", preprocess=_pad)


@pytest.mark.spark
@pytest.mark.exact
def test_the_logged_model_scores_batches_of_other_lengths_than_the_sample(fitted):
    import mlflow
    import pandas as pd

    df, result = fitted
    scored = result.transform(df).select("tokens", "prediction").toPandas()
    assert len(set(scored["prediction"])) > 1  # not one class for every row
    uri = f"runs:/{result.run_id}/model"
    assert mlflow.artifacts.download_artifacts(f"{uri}/data/model.pt2")  # exported, not pickled
    loaded = mlflow.pyfunc.load_model(uri)
    lengths = scored["tokens"].map(len)
    for rows in (scored[lengths <= 3], scored[lengths > 3]):  # longest 3, then 7
        frame = pd.DataFrame({"tokens": [list(map(int, t)) for t in rows["tokens"]]})
        logits, apart = bag_logits(result.model, frame["tokens"])
        assert classes_agree(loaded.predict(frame), logits, apart)
        assert classes_agree(rows["prediction"], logits, apart)
    assert {lengths[lengths <= 3].max(), lengths.max()} == {3, 7}


class BranchesOnLength(BagOfTokens):
    """Takes any length, but its code branches on it: torch.export draws a guard from the
    sample's length (5) and the exported program refuses any other."""

    def forward(self, tokens):
        out = super().forward(tokens)
        return out if tokens.shape[1] == 5 else out * 2


def test_an_export_fixing_a_length_the_model_takes_is_logged_pickled(monkeypatch, caplog):
    import logging

    import mlflow
    import pandas as pd

    from sparkdl_avg._model import pickle_for_executors
    from sparkdl_avg.data.schema import DataSchema, FieldSpec
    from sparkdl_avg.tracking.model import log_model

    def schema(dtype, shape):
        field = FieldSpec("input", "tokens", "tokens", "_x0", dtype, shape, "array<int>")
        return DataSchema(inputs=(field,), binding="single", labels=(), label_list=False)

    model = BranchesOnLength().eval()
    mlflow.set_experiment("preprocess-export")
    with mlflow.start_run() as run, caplog.at_level(logging.WARNING, "sparkdl_avg"):
        log_model(model, schema=schema("int32", (-1,)), heads=("class",),
                  preprocess=pickle_for_executors("preprocess", _pad),
                  model_schema=schema("int64", (5,)), pip_requirements=["torch"])
    assert "fixed dimension 1 of 'tokens' at 5" in caplog.text and "pickled" in caplog.text
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    loaded = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    for rows in ([[1, 2], [3, 4, 5]], [[1, 2, 3, 4, 5, 6, 7], [8]]):
        with torch.no_grad():
            expected = model(torch.from_numpy(_pad({"tokens": rows}, training=False,
                                                   rng=None)["tokens"])).argmax(1)
        assert loaded.predict(pd.DataFrame({"tokens": rows})).tolist() == expected.tolist()


def _pad_pair(batch, *, training, rng):
    """A tokenizer's two outputs: ids and a mask, padded to the same (the batch's longest)
    length."""
    ids = _pad({"tokens": batch["ids"]}, training=training, rng=rng)["tokens"]
    return {"ids": ids, "mask": (ids != 0).astype(np.int64)}


class PairBranchesOnLength(torch.nn.Module):
    """ids and an attention mask of one length; the code branches on it. Growing one input
    alone makes the model itself refuse the mismatch: only growing both shows the guard."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids, mask):
        out = self.head((self.embed(ids) * mask.unsqueeze(-1)).sum(1))
        return out if ids.shape[1] == 5 else out * 2


def test_inputs_sharing_a_length_are_grown_together_in_the_export_check(monkeypatch, caplog):
    import logging

    import mlflow
    import pandas as pd

    from sparkdl_avg._model import pickle_for_executors
    from sparkdl_avg.data.schema import DataSchema, FieldSpec
    from sparkdl_avg.tracking.model import log_model

    def schema(dtype, shape):
        fields = tuple(FieldSpec("input", name, name, f"_x{i}", dtype, shape, "array<int>")
                       for i, name in enumerate(("ids", "mask")))
        return DataSchema(inputs=fields, binding="positional", labels=(), label_list=False)

    model = PairBranchesOnLength().eval()
    mlflow.set_experiment("preprocess-export")
    with mlflow.start_run() as run, caplog.at_level(logging.WARNING, "sparkdl_avg"):
        log_model(model, schema=schema("int32", (-1,)), heads=("class",),
                  preprocess=pickle_for_executors("preprocess", _pad_pair),
                  model_schema=schema("int64", (5,)), pip_requirements=["torch"])
    assert "dimension 1 of 'ids' at 5, dimension 1 of 'mask' at 5" in caplog.text
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    loaded = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    rows = [[1, 2, 3, 4, 5, 6, 7], [8]]  # longest 7
    pair = _pad_pair({"ids": rows}, training=False, rng=None)
    with torch.no_grad():
        expected = model(torch.from_numpy(pair["ids"]), torch.from_numpy(pair["mask"]))
    got = loaded.predict(pd.DataFrame({"ids": rows, "mask": [[1] * len(r) for r in rows]}))
    assert got.tolist() == expected.argmax(1).tolist()
