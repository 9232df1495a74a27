"""A string column through `fit(preprocess=)` (issue 39): a tokenizer-fed text classifier
trains from text as it is (preprocess gets each batch's rows as a list of `str`, non-ASCII
ones whole), carried as UTF-8 bytes through the disk cache and evaluation, and scores the
same through `transform`, `predict_udf` and the logged MLflow model, whose signature takes
a string column. A null string is refused by validation, naming the column, and an eval_df
holding the column as binary before it; without a preprocess a string column is refused,
saying to pass one."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkdl_avg import DataError, TrainConfig, fit

WORDS = ["good", "great", "très", "bon", "bad", "awful", "mauvais", "☹", "the", "film", "was"]
VOCAB = {w: i + 2 for i, w in enumerate(WORDS)}  # 0 pads, 1 is any other word
ROWS = 32


def tokenize(batch, *, training, rng):
    """A whitespace tokenizer: each row's word ids, padded with 0 to the batch's longest."""
    texts = batch["text"]
    if not all(isinstance(t, str) for t in texts):
        raise TypeError(f"expected str rows, got {type(texts[0]).__name__}")
    rows = [[VOCAB.get(w, 1) for w in t.split()] for t in texts]
    ids = np.zeros((len(rows), max(map(len, rows))), np.int64)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = row
    return {"text": ids}


class BagOfWords(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(len(VOCAB) + 2, 8, padding_idx=0)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids):
        return self.head(self.embed(ids).sum(1))


def _sentences(rng, rows: int) -> list[tuple[str, int]]:
    good, bad = WORDS[:4], WORDS[4:8]
    out = []
    for i in range(rows):
        label = i % 2
        words = list(rng.choice(bad if label else good, rng.integers(1, 4)))
        words += list(rng.choice(["the", "film", "was", "plot"], rng.integers(0, 3)))
        rng.shuffle(words)
        out.append((" ".join(words), label))
    return out


@pytest.fixture(scope="module")
def texts(spark):
    rng = np.random.default_rng(5)
    return spark.createDataFrame(_sentences(rng, ROWS), "text string, label long").cache()


@pytest.fixture(scope="module")
def fitted(texts):
    config = TrainConfig(num_workers=2, epochs=3, batch_size=4, lr=0.5, seed=2,
                         data_cache="disk", experiment_name="preprocess-text")
    return fit(texts, BagOfWords, config, features_col="text", preprocess=tokenize,
               eval_df=texts)


def _eager(model, sentences: list[str]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.from_numpy(tokenize({"text": sentences}, training=False,
                                               rng=None)["text"]))


@pytest.mark.spark
def test_a_tokenizer_fed_text_classifier_trains_and_scores_from_strings(texts, fitted):
    assert {w["cache"] for w in fitted.workers} == {"disk"}
    assert [h["eval_accuracy"] for h in fitted.history if "eval_accuracy" in h][-1] >= 0.9
    scored = fitted.transform(texts, output="raw").toPandas()
    eager = _eager(fitted.model, list(scored["text"]))
    got = torch.tensor(np.stack(scored["prediction"].to_numpy()), dtype=torch.float32)
    # the same float32 layers on the same rows, padded to other lengths (zero embeddings):
    # a few ulps of the logits (about 1) apart at most
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    udf = texts.select("text", fitted.predict_udf(output="raw")("text").alias("p")).toPandas()
    torch.testing.assert_close(torch.tensor(np.stack(udf["p"].to_numpy()), dtype=torch.float32),
                               _eager(fitted.model, list(udf["text"])), rtol=1e-5, atol=1e-5)


@pytest.mark.spark
def test_the_logged_model_takes_a_string_column(texts, fitted):
    import mlflow
    import pandas as pd

    loaded = mlflow.pyfunc.load_model(f"runs:/{fitted.run_id}/model")
    inputs = loaded.metadata.get_input_schema().inputs
    assert [(c.name, c.type.name) for c in inputs] == [("text", "string")]
    sentences = [s for s, _ in _sentences(np.random.default_rng(9), 6)] + ["très ☹ ??"]
    got = loaded.predict(pd.DataFrame({"text": sentences}), params={"output": "raw"})
    torch.testing.assert_close(torch.tensor(np.asarray(got), dtype=torch.float32),
                               _eager(fitted.model, sentences), rtol=1e-5, atol=1e-5)


@pytest.mark.spark
def test_a_string_column_needs_a_preprocess_and_no_nulls(spark, texts):
    config = TrainConfig(num_workers=1, epochs=1, batch_size=4, log_model=False)
    with pytest.raises(DataError, match=r"column 'text' has type string.*"
                                        r"fit\(preprocess=fn\), which gets it as a list of str"):
        fit(texts, BagOfWords, config, features_col="text")
    holes = spark.createDataFrame([("good film", 0), (None, 1), ("bad", 1), ("the", 0)],
                                  "text string, label long")
    with pytest.raises(DataError, match=r"train_df has 1 rows whose features \('text'\) is "
                                        r"null"):
        fit(holes, BagOfWords, config, features_col="text", preprocess=tokenize)
    # the same column as bytes elsewhere would reach preprocess as bytes: refused
    as_bytes = texts.selectExpr("cast(text as binary) as text", "label")
    with pytest.raises(DataError, match="column 'text' is binary in eval_df but string in "
                                        "train_df"):
        fit(texts, BagOfWords, config, features_col="text", preprocess=tokenize,
            eval_df=as_bytes)
