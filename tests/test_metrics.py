"""Evaluation metrics beyond the loss (`fit(metrics=)`): each worker's statistics over its
chunks, merged over workers (`_eval_sums.merge`) and finalized on the driver, equal the
metric over all the evaluation rows at once: auc against sklearn's roc_auc_score (ties and
weights included), perplexity against torch's cross entropy of every token at once, a custom
metric against its eager value. Bad metrics are refused before any Spark job."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from sparkdl_avg import ConfigError, DataError, Metric, ModelError, TrainConfig
from sparkdl_avg._errors import ProtocolError
from sparkdl_avg._eval_sums import merge, split_tables, table_of
from sparkdl_avg._losses import make_objective
from sparkdl_avg._metrics import (
    Accumulator,
    check_metrics,
    check_table_rows,
    final_values,
    make_metrics,
)
from sparkdl_avg.driver.plan import check_evaluation
from sparkdl_avg.net.fields import MAX_TABLE_ROWS

# float64 sums of a few hundred terms: rounding far below this
EXACT = 1e-12


def _evaluate(metrics, chunks_by_worker) -> dict:
    """Each worker's chunks through an Accumulator, as `task.evaluate` runs them; the parts
    merged as the drivers merge them; the final values."""
    parts = []
    for chunks in chunks_by_worker:
        acc = Accumulator(metrics)
        for output, labels, weights in chunks:
            acc.add(output, labels, weights)
        sums, tables = acc.result()
        parts.append({"loss_sum": 0.0, "loss_weight": 0.0, "correct": None, "scored": None,
                      "count": 0, "eval_s": 0.0, "metrics": sums, "tables": tables})
    return final_values(metrics, merge(parts)["metrics"])


def _split(n: int, workers: int, chunk: int, rng) -> list[list[np.ndarray]]:
    """Row indices: a random assignment to workers, each worker's in chunks of `chunk`."""
    owner = rng.integers(0, workers, n)
    return [[idx[i:i + chunk] for i in range(0, len(idx), chunk)]
            for idx in (np.flatnonzero(owner == w) for w in range(workers))]


def test_auc_of_one_logit_per_row_is_sklearns_over_chunks_and_workers():
    rng = np.random.default_rng(0)
    n = 300
    # rounded scores: many ties within and across workers, which count half
    scores = np.round(rng.normal(size=n), 1).astype(np.float32)
    labels = (rng.random(n) < 1 / (1 + np.exp(-2 * scores))).astype(np.float32)
    weights = rng.integers(0, 4, n).astype(np.float64)  # 0 too: a row that counts nothing
    for w, split in ((None, _split(n, 2, 7, rng)), (weights, _split(n, 3, 16, rng))):
        chunks = [[(torch.from_numpy(scores[i]).reshape(-1, 1), (torch.from_numpy(labels[i]),),
                    None if w is None else torch.from_numpy(w[i])) for i in worker]
                  for worker in split]
        got = _evaluate(("auc",), chunks)["eval_auc"]
        assert got == pytest.approx(roc_auc_score(labels, scores, sample_weight=w), abs=EXACT)


def test_auc_of_two_classes_ranks_by_the_logit_difference_and_skips_ignored_rows():
    rng = np.random.default_rng(1)
    n = 200
    logits = rng.normal(size=(n, 2)).astype(np.float32)
    labels = rng.integers(0, 2, n)
    labels[rng.random(n) < 0.1] = -100
    kept = labels != -100
    chunks = [[(torch.from_numpy(logits[i]), (torch.from_numpy(labels[i]),), None)
               for i in worker] for worker in _split(n, 2, 9, rng)]
    got = _evaluate(("auc",), chunks)["eval_auc"]
    probability = torch.softmax(torch.from_numpy(logits).double(), -1)[:, 1].numpy()
    assert got == pytest.approx(roc_auc_score(labels[kept], probability[kept]), abs=EXACT)


def test_perplexity_is_exp_of_every_kept_tokens_cross_entropy_at_once():
    rng = np.random.default_rng(2)
    rows, tokens, classes = 40, 6, 5
    logits = torch.from_numpy(rng.normal(size=(rows, tokens, classes)).astype(np.float32))
    labels = torch.from_numpy(rng.integers(0, classes, (rows, tokens)))
    labels[torch.from_numpy(rng.random((rows, tokens)) < 0.2)] = -100
    weights = torch.from_numpy(rng.integers(1, 3, rows).astype(np.float32))
    chunks = [[(logits[i], (labels[i],), weights[i]) for i in worker]
              for worker in _split(rows, 2, 3, rng)]
    got = _evaluate(("perplexity",), chunks)["eval_perplexity"]
    per_token = F.cross_entropy(logits.double().reshape(-1, classes), labels.reshape(-1),
                                reduction="none", ignore_index=-100).reshape(rows, tokens)
    token_weight = weights.double()[:, None] * (labels != -100)
    mean = float((per_token * token_weight).sum() / token_weight.sum())
    # the workers' token losses are float32, as the model's logits (the eval loss's are too):
    # each within a few float32 ulps of these, so their mean within a few ulps of `mean`, and
    # exp turns that absolute error of the mean into a relative one
    tolerance = 8 * float(np.finfo(np.float32).eps) * max(1.0, mean)
    assert got == pytest.approx(math.exp(mean), rel=tolerance)


def mean_absolute_error(output, label, weights):
    return (output.reshape(-1) - label).abs().sum(), label.numel()


RMSE = Metric("rmse", lambda out, label, w: [((out.reshape(-1) - label) ** 2).sum(),
                                             float(label.numel())],
              finalize=lambda totals: math.sqrt(totals[0] / totals[1]))


def test_custom_metrics_add_their_sums_and_finalize_once():
    rng = np.random.default_rng(3)
    n = 90
    out = torch.from_numpy(rng.normal(size=(n, 1)))
    label = torch.from_numpy(rng.normal(size=n))
    metrics = make_metrics([mean_absolute_error, RMSE], make_objective("mse"))
    chunks = [[(out[i], (label[i],), None) for i in worker] for worker in _split(n, 3, 8, rng)]
    got = _evaluate(metrics, chunks)
    error = out.reshape(-1) - label
    assert got["eval_mean_absolute_error"] == pytest.approx(float(error.abs().mean()),
                                                            rel=EXACT)
    assert got["eval_rmse"] == pytest.approx(float(error.pow(2).mean().sqrt()), rel=EXACT)


def test_a_worker_without_rows_adds_nothing_and_a_diverged_one_makes_nan():
    objective = make_objective("cross_entropy")
    metrics = make_metrics(["auc", "perplexity"], objective)
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 2.0]])
    labels = torch.tensor([1, 0, 0])
    alone = _evaluate(metrics, [[(logits, (labels,), None)]])
    assert _evaluate(metrics, [[(logits, (labels,), None)], []]) == alone
    diverged = [[(logits, (labels,), None)],
                [(torch.tensor([[float("nan"), 0.0]]), (torch.tensor([1]),), None)]]
    assert all(math.isnan(v) for v in _evaluate(metrics, diverged).values())


def test_score_tables_that_do_not_fit_are_refused():
    table = table_of(np.array([0.5, 0.1, 0.5]), np.array([True, False, False]),
                     np.ones(3))
    assert table.tolist() == [[0.1, 0.0, 1.0], [0.5, 1.0, 1.0]]
    assert split_tables({"auc": 2}, table.reshape(-1))["auc"].tolist() == table.tolist()
    for ranked, payload, match in [
            ({"auc": 3}, table.reshape(-1), "3 score-table rows need 72 payload bytes"),
            ({"auc": 2}, table[::-1].reshape(-1).copy(), "not sorted"),
            ({"auc": 2}, np.array([0.1, -1.0, 1.0, 0.5, 1.0, 1.0]), "negative weight"),
            ({"auc": 2}, np.array([0.1, 0.0, 1.0, np.nan, 1.0, 1.0]), "NaN")]:
        with pytest.raises(ProtocolError, match=match):
            split_tables(ranked, payload)


def test_bad_metrics_are_refused_naming_what_to_do():
    regression, classifier = make_objective("mse"), make_objective("bce_with_logits")
    cases = [
        ("accuracy_at_5", classifier, "is not a known metric; use one of 'auc', 'perplexity'"),
        ("auc", regression, r"auc.*binary classifier.*loss='mse'"),
        ("perplexity", classifier, r"perplexity.*needs loss='cross_entropy'.*'bce_with_logits'"),
        ("perplexity", make_objective("model", inputs={"input_ids": "x"}),
         "model's own loss is a mean per chunk"),
        (["auc"], make_objective(["bce_with_logits", "mse"], num_outputs=2),
         "one output .one label column.; this fit has 2"),
        ([lambda o, y, w: (o.sum(), 1)], regression, "name it with Metric"),
        ([Metric("loss", mean_absolute_error)], regression, "other than loss"),
        (["auc", "auc"], classifier, "names 'auc' twice"),
        ([3], classifier, "got int"),
    ]
    for metrics, objective, match in cases:
        with pytest.raises(ConfigError, match=match):
            make_metrics(metrics, objective)
    with pytest.raises(ConfigError, match="give fit an eval_df"):
        check_evaluation(TrainConfig(), dataclasses.replace(classifier, metrics=("auc",)),
                         has_eval=False)
    with pytest.raises(ConfigError, match="eval_before_training=True evaluates on eval_df"):
        check_evaluation(TrainConfig(eval_before_training=True), classifier, has_eval=False)
    with pytest.raises(ConfigError, match="eval_before_training must be True, False or None"):
        TrainConfig(eval_before_training="yes")
    with pytest.raises(DataError, match=f"for at most {MAX_TABLE_ROWS} rows"):
        check_table_rows(("auc",), MAX_TABLE_ROWS + 1)
    check_table_rows(("perplexity",), MAX_TABLE_ROWS + 1)  # sums only: no bound


def test_the_probe_refuses_a_metric_that_cannot_score_the_model():
    labels = (torch.tensor([0, 1]),)
    with pytest.raises(ModelError, match=r"auc.*the model outputs \(2, 10\)"):
        check_metrics(("auc",), torch.zeros(2, 10), labels)
    with pytest.raises(ModelError, match="sums returned 3 numbers; it must return 2"):
        check_metrics((Metric("three", lambda o, y, w: (1.0, 2.0, 3.0)),),
                      torch.zeros(2, 1), labels)
    with pytest.raises(ModelError, match="finalize.*ZeroDivisionError"):
        check_metrics((Metric("broken", lambda o, y, w: [1.0], finalize=lambda t: 1 / 0),),
                      torch.zeros(2, 1), labels)
    check_metrics(("auc",), torch.zeros(2, 2), labels)  # two classes: fine
