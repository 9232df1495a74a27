"""The built-in losses on any shape, per-row weights, several outputs, and evaluation sums,
each against an independent computation in float64 (pure torch, no Spark)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from sparkdl_avg import ConfigError, ModelError
from sparkdl_avg._losses import LOSSES, check_outputs, make_loss, make_objective
from sparkdl_avg.data.schema import Batch, DataSchema, FieldSpec
from sparkdl_avg.task.evaluate import eval_means, evaluate_batches

F64 = torch.float64


def _log_softmax_by_hand(row: list[float], k: int) -> float:
    return row[k] - math.log(sum(math.exp(v) for v in row))


def _sequence_batch(seed: int = 0, rows: int = 5, steps: int = 4, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, steps, classes, dtype=F64, generator=g)
    labels = torch.randint(0, classes, (rows, steps), generator=g)
    labels[0, 2:] = -100  # padding of a short row
    labels[3, :] = -100  # a row that is all padding
    labels[4, 0] = -100
    return logits, labels


@pytest.mark.exact
def test_cross_entropy_on_sequences_ignores_minus_100_positions():
    logits, labels = _sequence_batch()
    objective = make_objective("cross_entropy")
    kept = [(b, t) for b in range(5) for t in range(4) if labels[b, t] != -100]
    by_hand = -sum(_log_softmax_by_hand(logits[b, t].tolist(), int(labels[b, t]))
                   for b, t in kept) / len(kept)
    assert objective(logits, (labels,)).item() == pytest.approx(by_hand, abs=1e-12)
    sums = objective.evaluate(logits, (labels,))
    hits = sum(int(logits[b, t].argmax()) == int(labels[b, t]) for b, t in kept)
    assert (int(sums.correct), int(sums.scored)) == (hits, len(kept))
    assert sums.loss_weight.item() == len(kept)
    narrow = objective(logits, (labels.int(),))  # int32 ids: torch takes int64 indices only
    assert narrow.item() == pytest.approx(by_hand, abs=1e-12)


def _model_batch(name: str, rows: int, seed: int = 1):
    """(inputs, labels, linear map) giving built-in loss `name` outputs of a typical shape."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 3, dtype=F64, generator=g)
    if name == "cross_entropy":  # [B, T=2, C=4] logits, per-token labels, some ignored
        labels = torch.randint(0, 4, (rows, 2), generator=g)
        labels[1, 1] = labels[rows - 1, 0] = -100
        width = 8
    elif name == "bce_with_logits":  # multi-label, 0/1 integers
        labels, width = torch.randint(0, 2, (rows, 3), generator=g), 3
    elif name == "mse":  # one unit for a scalar label: [B, 1] against [B]
        labels, width = torch.randn(rows, dtype=F64, generator=g), 1
    else:
        labels, width = torch.randn(rows, 2, 2, dtype=F64, generator=g) * 3, 4
    return x, labels, torch.randn(3, width, dtype=F64, generator=g)


def _outputs(name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    out = x @ w
    if name == "cross_entropy":
        return out.reshape(len(x), 2, 4)
    return out.reshape(len(x), 2, 2) if name in ("l1", "huber") else out


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.exact
def test_a_row_of_weight_w_counts_as_w_copies_for_every_built_in_loss(name):
    x, labels, w0 = _model_batch(name, rows=6)
    weights = torch.tensor([2.0, 0.0, 1.0, 3.0, 1.0, 2.0], dtype=F64)
    copies = weights.long()
    objective = make_objective(name, weighted=True)
    results = []
    for xs, ys, ws in ((x, labels, weights),  # weighted, and each row repeated w times
                       (x.repeat_interleave(copies, 0), labels.repeat_interleave(copies, 0),
                        None)):
        w = w0.clone().requires_grad_(True)
        loss = objective(_outputs(name, xs, w), (ys,), ws)
        loss.backward()
        results.append((loss.item(), w.grad))
    (weighted, grad_weighted), (copied, grad_copied) = results
    assert weighted == pytest.approx(copied, abs=1e-12)
    assert torch.allclose(grad_weighted, grad_copied, rtol=0, atol=1e-12)
    assert grad_weighted.abs().sum() > 0


@pytest.mark.exact
def test_two_outputs_with_two_losses_and_loss_weights_are_the_weighted_sum_by_hand():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 3, dtype=F64, generator=g)
    classes = torch.tensor([0, 2, 1, 2])
    values, targets = torch.randn(4, 2, dtype=F64, generator=g), torch.randn(4, 2, dtype=F64)
    weights = torch.tensor([1.0, 0.5, 2.0, 0.0], dtype=F64)
    objective = make_objective(["cross_entropy", "l1"], loss_weights=[0.3, 2.0],
                               num_outputs=2, weighted=True)
    ce = [-_log_softmax_by_hand(logits[i].tolist(), int(classes[i])) for i in range(4)]
    ce_mean = sum(w * v for w, v in zip(weights.tolist(), ce, strict=True)) / 3.5
    l1 = sum(weights[i].item() * abs(values[i, j].item() - targets[i, j].item())
             for i in range(4) for j in range(2)) / (2 * 3.5)
    value = objective((logits, values), (classes, targets), weights)
    assert value.item() == pytest.approx(0.3 * ce_mean + 2.0 * l1, abs=1e-12)
    sums = objective.evaluate((logits, values), (classes, targets), weights)
    assert sums.loss_weight.item() == 3.5  # the first output's kept weight
    assert sums.loss_sum.item() == pytest.approx(3.5 * value.item(), abs=1e-12)
    assert int(sums.scored) == 4  # only the classifying output is scored
    unweighted = make_objective(["cross_entropy", "l1"], num_outputs=2)
    by_hand = sum(ce) / 4 + (values - targets).abs().mean().item()
    assert unweighted((logits, values), (classes, targets)).item() == \
        pytest.approx(by_hand, abs=1e-12)


@pytest.mark.exact
def test_bce_with_logits_scores_each_label_of_a_multi_label_output():
    logits = torch.tensor([[2.0, -1.0, 0.5], [-3.0, 1.0, -0.2]])
    labels = torch.tensor([[1, 1, 0], [0, 1, 1]])  # hits: 1, 0, 0 / 1, 1, 0
    for given in (labels, labels.bool(), labels.float()):
        sums = make_objective("bce_with_logits").evaluate(logits, (given,))
        assert (int(sums.correct), int(sums.scored)) == (3, 6)
    by_hand = sum(math.log1p(math.exp(-z)) if y else math.log1p(math.exp(z))
                  for z, y in zip(logits.flatten().tolist(), labels.flatten().tolist(),
                                  strict=True)) / 6
    assert make_objective("bce_with_logits")(logits.double(), (labels,)).item() == \
        pytest.approx(by_hand, abs=1e-12)
    one_unit = make_objective("bce_with_logits").evaluate(  # a binary classifier's [B, 1]
        torch.tensor([[0.3], [-0.4], [0.1]]), (torch.tensor([1, 1, 0]),))
    assert (int(one_unit.correct), int(one_unit.scored)) == (1, 3)


def _chunks(logits, labels, weights, sizes):
    start = 0
    for size in sizes:
        end = start + size
        yield SimpleNamespace(inputs=(logits[start:end],), labels=(labels[start:end],),
                              weights=weights[start:end], rows=size)
        start = end


@pytest.mark.exact
def test_evaluation_in_chunks_sums_to_the_one_chunk_weighted_mean():
    logits, labels = _sequence_batch(seed=3, rows=9)
    weights = torch.tensor([0.5, 1.0, 0.0, 2.25, 1.0, 0.0, 3.0, 0.75, 1.5], dtype=F64)
    objective = make_objective("cross_entropy", weighted=True)
    whole = objective(logits, (labels,), weights).item()
    kept = [(b, t) for b in range(9) for t in range(4) if labels[b, t] != -100]
    by_hand = -sum(weights[b].item() * _log_softmax_by_hand(logits[b, t].tolist(),
                                                            int(labels[b, t]))
                   for b, t in kept) / sum(weights[b].item() for b, _ in kept)
    assert whole == pytest.approx(by_hand, abs=1e-12)
    # chunks of 2, 1 (weight 0), 3 and 3 rows, run through a model that is the identity
    model = torch.nn.Identity()
    result = evaluate_batches(model, _chunks(logits, labels, weights, (2, 1, 3, 3)),
                              objective, lambda m, inputs: m(*inputs))
    assert result["loss_sum"] / result["loss_weight"] == pytest.approx(whole, abs=1e-12)
    assert result["count"] == 9 and result["scored"] == len(kept)
    assert result["correct"] == sum(int(logits[b, t].argmax()) == int(labels[b, t])
                                    for b, t in kept)
    assert model.training  # left as it was


class _TwoHeads(torch.nn.Module):
    """Keyword inputs (a user id and a dense vector), two outputs: class logits and a score."""

    def __init__(self) -> None:
        super().__init__()
        self.users = torch.nn.Embedding(5, 3, dtype=F64)
        self.heads = torch.nn.Linear(5, 4, dtype=F64)

    def forward(self, user, dense):
        out = self.heads(torch.cat([self.users(user), dense], dim=1))
        return out[:, :3], out[:, 3]


@pytest.mark.exact
def test_evaluation_of_two_outputs_over_the_schemas_batches_and_binding():
    def field(role, name, dtype, wire):
        return FieldSpec(role=role, name=name, column=name, wire=wire, dtype=dtype, shape=())

    schema = DataSchema(inputs=(field("input", "user", "int64", "_x0"),
                                FieldSpec("input", "dense", "dense", "_x1", "float64", (2,))),
                        binding="keyword",
                        labels=(field("label", "kind", "int64", "_y0"),
                                field("label", "score", "float64", "_y1")),
                        label_list=True, weight=field("weight", "w", "float64", "_w"),
                        float_dtype="float64")
    g = torch.Generator().manual_seed(4)
    users, dense = torch.randint(0, 5, (7,), generator=g), torch.randn(7, 2, dtype=F64)
    kinds, scores = torch.randint(0, 3, (7,), generator=g), torch.randn(7, dtype=F64)
    weights = torch.tensor([1.0, 2.0, 0.5, 0.0, 1.0, 3.0, 1.0], dtype=F64)
    model = _TwoHeads()
    objective = make_objective(["cross_entropy", "mse"], loss_weights=[1.0, 0.5],
                               num_outputs=2, weighted=True)
    batches = [Batch((users[a:b], dense[a:b]), (kinds[a:b], scores[a:b]), weights[a:b])
               for a, b in ((0, 3), (3, 7))]
    result = evaluate_batches(model, batches, objective, schema.call)
    with torch.no_grad():
        logits, score = model(user=users, dense=dense)
    by_hand = [sum(w * v for w, v in zip(weights.tolist(), values, strict=True)) / 8.5
               for values in (F.cross_entropy(logits, kinds, reduction="none").tolist(),
                              ((score - scores) ** 2).tolist())]
    chunked = [objective((logits[a:b], score[a:b]), (kinds[a:b], scores[a:b]), weights[a:b])
               for a, b in ((0, 3), (3, 7))]
    first_weight = [weights[:3].sum().item(), weights[3:].sum().item()]
    # the cross-entropy term is exact over chunks; the second weighs each chunk's mean by
    # the first output's kept weight
    assert result["loss_sum"] == pytest.approx(
        sum(c.item() * w for c, w in zip(chunked, first_weight, strict=True)), abs=1e-12)
    assert result["loss_weight"] == 8.5 and result["count"] == 7 and result["scored"] == 7
    assert objective((logits, score), (kinds, scores), weights).item() == pytest.approx(
        by_hand[0] + 0.5 * by_hand[1], abs=1e-12)


def test_a_chunk_that_keeps_nothing_has_loss_0_and_a_finite_gradient():
    logits = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    ignored = torch.full((2, 3), -100)
    loss = make_objective("cross_entropy")(logits, (ignored,))
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logits.grad, torch.zeros_like(logits))
    zero = make_objective("mse", weighted=True)(logits, (torch.ones(2, 3, 4),),
                                                torch.zeros(2, dtype=F64))
    assert zero.item() == 0.0
    assert eval_means(0.0, 0.0, 0, 0) == (0.0, 0.0)
    loss, accuracy = eval_means(None, 4.0, None, None)
    assert math.isnan(loss) and accuracy is None


def test_evaluation_of_a_regressor_has_no_accuracy_and_of_no_rows_nothing():
    objective = make_objective("mse")
    out, labels = torch.tensor([[1.0], [2.0]], dtype=F64), torch.tensor([0.0, 4.0], dtype=F64)
    batch = SimpleNamespace(inputs=(out,), labels=(labels,), weights=None, rows=2)
    result = evaluate_batches(torch.nn.Identity(), [batch], objective,
                              lambda m, inputs: m(*inputs))
    assert result == {"loss_sum": 5.0, "loss_weight": 2.0, "correct": None, "scored": None,
                      "count": 2, "metrics": {}, "tables": {}}  # no fit(metrics=)
    empty = evaluate_batches(torch.nn.Identity(), [], make_objective("cross_entropy"),
                             lambda m, inputs: m(*inputs))
    assert empty == {"loss_sum": 0.0, "loss_weight": 0.0, "correct": 0, "scored": 0,
                     "count": 0, "metrics": {}, "tables": {}}


def test_callables_get_weights_when_the_fit_has_them_and_every_output_when_joint():
    seen = []

    def loss(output, label, *weights):
        seen.append((type(output).__name__, len(weights)))
        first = output[0] if isinstance(output, tuple) else output
        return first.sum() * 0 + 2.0

    out, label, weights = torch.ones(3, 2), torch.ones(3, 2), torch.tensor([1.0, 0.0, 3.0])
    make_objective(loss)(out, (label,))
    make_objective(loss, weighted=True)(out, (label,), weights)
    joint = make_objective(loss, num_outputs=2, weighted=True)
    sums = joint.evaluate((out, out), (label, label), weights)
    assert seen == [("Tensor", 0), ("Tensor", 1), ("tuple", 1)]
    assert (sums.loss_sum.item(), sums.loss_weight.item(), sums.correct) == (8.0, 4.0, None)
    assert not joint.classify and joint.names == ("loss",)


@pytest.mark.exact
def test_make_loss_keeps_todays_callers_working():
    fn, classify = make_loss("cross_entropy")
    logits, labels = torch.randn(6, 4, dtype=F64), torch.tensor([0, 3, 1, 1, 2, 0])
    assert classify and fn(logits, labels).item() == pytest.approx(
        F.cross_entropy(logits, labels).item(), abs=1e-12)
    fn, classify = make_loss("mse")
    out, y = torch.randn(6, 1, dtype=F64), torch.randn(6, dtype=F64)
    assert not classify and fn(out, y).item() == pytest.approx(
        ((out.squeeze(-1) - y) ** 2).mean().item(), abs=1e-12)
    fn, classify = make_loss(F.l1_loss)
    assert not classify and fn(out, out + 1).item() == 1.0


def _two_outputs(*args, **kwargs):
    return make_objective(["cross_entropy", "mse"], num_outputs=2, **kwargs)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: make_objective("hinge"),
     r"loss='hinge' is not supported; use one of 'cross_entropy', 'bce_with_logits'"),
    (lambda: make_objective(3), "loss must be a loss name .* got int"),
    (lambda: make_objective("mse", num_outputs=2),
     r"loss='mse' names one loss for 2 outputs: give one loss per label column"),
    (lambda: make_objective(["mse"], num_outputs=2), "loss lists 1 loss for 2 outputs"),
    (lambda: make_objective(["mse", "hinge"], num_outputs=2),
     r"loss\[1\]='hinge' is not supported"),
    (lambda: make_objective(["mse", None], num_outputs=2), r"loss\[1\] must be a loss name"),
    (lambda: _two_outputs(loss_weights=[1.0]), "loss_weights must be a list of 2 numbers"),
    (lambda: _two_outputs(loss_weights="1,1"), "loss_weights must be a list of 2 numbers"),
    (lambda: _two_outputs(loss_weights=[1.0, float("nan")]),
     r"loss_weights\[1\]=nan must be a finite number >= 0"),
    (lambda: _two_outputs(loss_weights=[-1.0, 1.0]), r"loss_weights\[0\]=-1.0 must be"),
    (lambda: _two_outputs(loss_weights=[True, 1.0]), r"loss_weights\[0\]=True must be"),
    (lambda: _two_outputs(loss_weights=["1", 1.0]), r"loss_weights\[0\]='1' must be"),
    (lambda: _two_outputs(loss_weights=[0, 0.0]), "loss_weights are all 0"),
    (lambda: make_objective(F.mse_loss, num_outputs=2, loss_weights=[1.0, 1.0]),
     "the single callable loss gets every output"),
])
def test_bad_loss_and_loss_weights_are_refused_naming_the_argument(make, match):
    with pytest.raises(ConfigError, match=match):
        make()


def _raises(_output, _label):
    raise RuntimeError("boom")


@pytest.mark.parametrize(("objective", "outputs", "labels", "match"), [
    (_two_outputs(), torch.zeros(4, 3), (torch.zeros(4, dtype=torch.long), torch.zeros(4)),
     r"must return a tuple of 2 tensors, one per label column \('y', 'z'\); it returns a "
     r"tensor of shape \(4, 3\)"),
    (_two_outputs(), (torch.zeros(4, 3),), (torch.zeros(4, dtype=torch.long), torch.zeros(4)),
     "a tuple of 1"),
    (_two_outputs(), (torch.zeros(4, 3), 1.0),
     (torch.zeros(4, dtype=torch.long), torch.zeros(4)), "a tuple of 2"),
    (make_objective("mse"), (torch.zeros(4, 1), torch.zeros(4, 1)), (torch.zeros(4),),
     "returns a tuple of 2 but label column 'y' needs one tensor"),
    (make_objective("cross_entropy"), torch.zeros(4, 3), (torch.zeros(4, 5, dtype=torch.long),),
     r"label column 'y': cross_entropy needs outputs of the labels' shape plus a last "
     r"dimension of classes, \(4, 5, 'C'\); got \(4, 3\)"),
    (make_objective("mse"), torch.zeros(4, 3), (torch.zeros(4, 2),),
     r"label column 'y': mse needs outputs of the labels' shape \(4, 2\); got \(4, 3\)"),
    (make_objective("huber"), torch.zeros(4, 2), (torch.zeros(4),),
     r"huber needs outputs of the labels' shape \(4,\) \(or with a last dimension of 1\)"),
    (make_objective("bce_with_logits"), torch.zeros(4), (torch.zeros(4, 1),),
     r"bce_with_logits needs outputs of the labels' shape \(4, 1\); got \(4,\)"),
    (make_objective("cross_entropy"), torch.zeros(2, 3), (torch.tensor([0, 5]),),
     r"labels range from 0 to 5 but the model outputs 3 classes"),
    (make_objective("cross_entropy"), torch.zeros(2, 2, 3), (torch.tensor([[-1, -100], [2, 1]]),),
     r"labels range from -1 to 2 but the model outputs 3 classes"),
    (make_objective("cross_entropy"), torch.zeros(2, 3), (torch.tensor([0.0, 1.0]),),
     "label column 'y' holds torch.float32: cross_entropy needs integer class labels"),
    (make_objective(_raises), torch.zeros(2, 3), (torch.zeros(2, 3),),
     r"the loss fails on the model's outputs \[\(2, 3\)\] for label column\(s\) 'y' of "
     r"shape\(s\) \[\(2, 3\)\]: RuntimeError\('boom'\)"),
    (make_objective(lambda o, y: (o - y) ** 2), torch.zeros(2, 3), (torch.zeros(2, 3),),
     "must return a scalar tensor, got a tensor of shape"),
])
def test_the_probe_refuses_outputs_that_cannot_meet_their_labels(objective, outputs, labels,
                                                                 match):
    with pytest.raises(ModelError, match=match):
        check_outputs(objective, outputs, labels, ["y", "z"][:objective.num_outputs])


def test_the_probe_accepts_outputs_that_meet_their_labels():
    tokens = torch.tensor([[0, 2, -100], [1, -100, -100]])
    check_outputs(make_objective("cross_entropy"), torch.zeros(2, 3, 3), (tokens,), ["y"])
    check_outputs(make_objective("mse", weighted=True), torch.zeros(2, 1), (torch.zeros(2),),
                  ["y"])
    check_outputs(_two_outputs(), (torch.zeros(2, 4), torch.zeros(2, 2)),
                  (torch.tensor([0, 3]), torch.zeros(2, 2)), ["y", "z"])
