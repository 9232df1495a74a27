"""Typed inputs end to end (issue 29): integer ids, several inputs bound by name, ragged
sequences, weights and several outputs, each against an independent computation in float64
(plain torch, row by row or with duplicated rows), and the typed errors a fit raises before
training (or, for an id beyond an embedding met in training, as a final error)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.sql import functions as F

from sparkdl_avg import DataError, ModelError, TrainConfig, fit

pytestmark = pytest.mark.spark

USERS, ITEMS, VOCAB = 12, 9, 20
BASE = dict(num_workers=1, epochs=3, optimizer="sgd", lr=0.1, shuffle=False, seed=3,
            log_model=False, experiment_name="typed-fits")


class Recommender(torch.nn.Module):
    """user and item ids, a dense vector and a ragged bag of tokens (id 0 pads) -> 3 logits;
    refuses any dtype but int64 for the ids."""

    def __init__(self, users: int = USERS, dtype=torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.user = torch.nn.Embedding(users, 3)
        self.item = torch.nn.Embedding(ITEMS, 3)
        self.tokens = torch.nn.EmbeddingBag(VOCAB, 3, mode="sum", padding_idx=0)
        self.dense = torch.nn.Linear(2, 3)
        self.to(dtype)

    def forward(self, user, item, dense, tokens):
        for name, ids in (("user", user), ("item", item), ("tokens", tokens)):
            if ids.dtype != torch.int64:
                raise TypeError(f"{name} arrived as {ids.dtype}")
        return self.user(user) + self.item(item) + self.dense(dense) + self.tokens(tokens)


BY_NAME = {"user": "user_id", "item": "item_id", "dense": "dense", "tokens": "tokens"}


@pytest.fixture(scope="module")
def ratings(spark):
    """96 rows: int32 user ids, int64 item ids, a float vector, ragged int32 tokens, a label
    that the user id decides, and a weight of 1 to 3."""
    rng = np.random.default_rng(1)
    n = 96
    users = rng.integers(0, USERS, n)
    pdf = pd.DataFrame({
        "user_id": users.astype(np.int32), "item_id": rng.integers(0, ITEMS, n),
        "dense": [r.tolist() for r in rng.normal(size=(n, 2))],
        "tokens": [rng.integers(1, VOCAB, rng.integers(1, 6)).astype(np.int32).tolist()
                   for _ in range(n)],
        "label": users % 3, "weight": rng.integers(1, 4, n).astype(float)})
    return spark.createDataFrame(pdf).coalesce(1)


def test_integer_ids_reach_the_model_as_int64_and_an_embedding_learns(ratings):
    result = fit(ratings, Recommender, TrainConfig(**{**BASE, "epochs": 25, "batch_size": 16,
                                                      "lr": 0.3}),
                 inputs=BY_NAME, eval_df=ratings)
    assert result.history[-1]["eval_accuracy"] >= 0.95
    assert result.history[0]["eval_loss"] > 2 * result.history[-1]["eval_loss"]


def _linear64() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(3, 1).double()


@pytest.mark.exact
def test_a_row_of_weight_w_counts_as_w_copies(spark):
    """Float64, one worker, full-batch SGD: weights against the rows repeated."""
    rng = np.random.default_rng(2)
    x, y, w = rng.normal(size=(20, 3)), rng.normal(size=20), rng.integers(1, 4, 20)
    weighted = spark.createDataFrame(pd.DataFrame(
        {"features": list(x), "label": y, "w": w.astype(float)}))
    copies = np.repeat(np.arange(20), w)
    duplicated = spark.createDataFrame(pd.DataFrame({"features": list(x[copies]),
                                                     "label": y[copies]}))
    cfg = {**BASE, "epochs": 30, "lr": 0.05}
    a = fit(weighted, _linear64, TrainConfig(**cfg, batch_size=20), loss="mse",
            weight_col="w")
    b = fit(duplicated, _linear64, TrainConfig(**cfg, batch_size=len(copies)), loss="mse")
    moved = (a.model.weight - _linear64().weight).abs().max().item()
    assert moved > 0.1
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert (pa - pb).abs().max().item() < 1e-10


class MaskedSum(torch.nn.Module):
    """A ragged float sequence and its length -> a weighted sum of the positions before the
    length: padding cannot change it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(6, dtype=torch.float64))
        self.b = torch.nn.Parameter(torch.zeros((), dtype=torch.float64))

    def forward(self, seq, length):
        keep = torch.arange(seq.shape[1])[None, :] < length[:, None]
        return (seq * self.w[: seq.shape[1]] * keep).sum(1) + self.b


@pytest.mark.exact
def test_ragged_sequences_padded_per_batch_equal_row_by_row(spark):
    rng = np.random.default_rng(3)
    seqs = [rng.normal(size=rng.integers(1, 7)) for _ in range(24)]
    y = rng.normal(size=24)
    df = spark.createDataFrame(pd.DataFrame({"seq": [s.tolist() for s in seqs], "y": y})) \
        .coalesce(1).withColumn("length", F.size("seq"))
    result = fit(df, MaskedSum, TrainConfig(**BASE, batch_size=4), inputs=["seq", "length"],
                 label_col="y", loss="mse")
    reference = MaskedSum()
    opt = torch.optim.SGD(reference.parameters(), lr=BASE["lr"])
    for _ in range(BASE["epochs"]):
        for start in range(0, 24, 4):  # each row alone, unpadded
            opt.zero_grad()
            loss = sum((reference(torch.tensor(seqs[i])[None], torch.tensor([len(seqs[i])]))
                        - y[i]) ** 2 for i in range(start, start + 4)) / 4
            loss.backward()
            opt.step()
    assert (result.model.w - MaskedSum().w).abs().max().item() > 1e-2
    assert (result.model.w - reference.w).abs().max().item() < 1e-10
    assert abs(result.model.b.item() - reference.b.item()) < 1e-10


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Linear(3, 4).double()
        self.cls = torch.nn.Linear(4, 3).double()
        self.reg = torch.nn.Linear(4, 1).double()

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.cls(h), self.reg(h)


@pytest.mark.exact
def test_two_outputs_with_two_losses_and_loss_weights_equal_the_weighted_sum(spark):
    rng = np.random.default_rng(4)
    x, c, r = rng.normal(size=(16, 3)), rng.integers(0, 3, 16), rng.normal(size=16)
    df = spark.createDataFrame(pd.DataFrame({"features": list(x), "c": c, "r": r}))
    result = fit(df, TwoHeads, TrainConfig(**BASE, batch_size=16), label_col=["c", "r"],
                 loss=["cross_entropy", "mse"], loss_weights=[1.0, 0.25])
    reference = TwoHeads()
    opt = torch.optim.SGD(reference.parameters(), lr=BASE["lr"])
    xt, ct, rt = torch.tensor(x), torch.tensor(c), torch.tensor(r)
    for _ in range(BASE["epochs"]):
        opt.zero_grad()
        logits, value = reference(xt)
        loss = torch.nn.functional.cross_entropy(logits, ct) \
            + 0.25 * ((value[:, 0] - rt) ** 2).mean()
        loss.backward()
        opt.step()
    for pa, pb in zip(result.model.parameters(), reference.parameters(), strict=True):
        assert (pa - pb).abs().max().item() < 1e-10


class NoTokens(Recommender):
    def forward(self, user, item, dense):
        return self.user(user) + self.item(item) + self.dense(dense)


def test_an_input_bound_to_no_parameter_of_forward_is_named(ratings, mlflow_client):
    with pytest.raises(ModelError, match=r"inputs binds 'tokens' \(column 'tokens'\), but "
                                         r"NoTokens.forward has no such parameter; its "
                                         r"parameters: \['user', 'item', 'dense'\]"):
        fit(ratings, NoTokens, TrainConfig(**BASE, batch_size=8), inputs=BY_NAME)
    run = _last_run(mlflow_client)
    assert run.info.status == "FAILED" and "ModelError" in run.data.tags["error"]


def test_an_embedding_too_small_for_the_ids_fails_on_the_driver(ratings):
    def small():
        return Recommender(users=5)

    with pytest.raises(ModelError, match=r"indexed out of range.*column 'user_id' \(input "
                                         r"'user'\) up to 11.*num_embeddings = largest \+ 1"):
        fit(ratings, small, TrainConfig(**BASE, batch_size=8), inputs=BY_NAME)


class ShiftsWhenTraining(Recommender):
    """Fine on the driver's probe (eval mode); in training its user ids run past the table."""

    def forward(self, user, item, dense, tokens):
        return super().forward(user + USERS if self.training else user, item, dense, tokens)


def test_an_id_beyond_the_table_in_a_task_is_a_final_model_error(ratings):
    with pytest.raises(ModelError, match=r"indexed out of range.*column 'user_id' \(input "
                                         r"'user'\) up to \d+.*num_embeddings"):
        fit(ratings, ShiftsWhenTraining,
            TrainConfig(**BASE, batch_size=8, max_failures=3), inputs=BY_NAME)


def _last_run(client):
    exp = client.get_experiment_by_name("typed-fits")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])[0]


class PerToken(torch.nn.Module):
    """Token ids -> 3 logits per position ([B, T, 3]); a position's output does not depend
    on the padding after it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 4).double()
        self.out = torch.nn.Linear(4, 3).double()

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


@pytest.mark.exact
def test_accumulated_micro_batches_weigh_their_kept_tokens_and_weights(ratings):
    """Per-token labels (ragged, padded with -100) and row weights: micro-batches of 8 rows
    keep different numbers of tokens and weights, and two of them accumulated make exactly
    the step one batch of 16 makes (float64, 1e-10); weighing them by rows would not."""
    df = ratings.withColumn("tags", F.transform("tokens", lambda t: t % 3))
    cfg = {**BASE, "epochs": 2, "lr": 0.5}
    one = fit(df, PerToken, TrainConfig(**cfg, batch_size=16), features_col="tokens",
              label_col="tags", weight_col="weight")
    two = fit(df, PerToken, TrainConfig(**cfg, batch_size=8, grad_accumulation=2),
              features_col="tokens", label_col="tags", weight_col="weight")
    assert (one.model.out.weight - PerToken().out.weight).abs().max().item() > 1e-2
    for a, b in zip(one.model.parameters(), two.model.parameters(), strict=True):
        assert (a - b).abs().max().item() < 1e-10


def test_a_ragged_label_with_a_loss_that_cannot_mask_its_pads_is_refused(spark):
    df = spark.createDataFrame(pd.DataFrame({"x": [[1.0, 2.0], [3.0]] * 4,
                                             "y": [[0.5, 1.5], [2.5]] * 4}))
    with pytest.raises(DataError, match=r"column 'y' \(label\) is ragged.*count in 'mse'"):
        fit(df, MaskedSum, TrainConfig(**BASE, batch_size=2), features_col="x",
            label_col="y", loss="mse")
