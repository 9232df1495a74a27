"""The fit's objective: the built-in losses on outputs of any shape, per-row weights, several
outputs, and evaluation sums that add up exactly over chunks and workers. Pure torch.

A built-in loss is the weighted mean of its kept elements: every element of a row's label
carries the row's weight w (1 without `weight_col`), and the loss is sum(w * l) / sum(w) over
the kept elements (all of them, except cross_entropy's positions labelled -100). So a row of
weight w counts exactly as w copies of it, a row of weight 0 not at all, and a token's loss
weighs the same wherever it sits. A chunk that keeps nothing (all weights 0, every label -100)
has loss 0, not NaN: its denominator counts as 1. Several outputs: the objective is
sum_k loss_weights[k] * loss_k. `loss="model"` is the model's own loss (`_model_output`).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sparkdl_avg._errors import ConfigError, ModelError
from sparkdl_avg._model_output import (
    MODEL_LOSS,
    as_tuple,
    check_model_loss,
    describe,
    loss_of,
    model_loss_term,
    output_tensors,
)
from sparkdl_avg.data.schema import IGNORE_INDEX  # a label that counts for nothing

LossFn = Callable[..., torch.Tensor]


def _cross_entropy(output: torch.Tensor, label: torch.Tensor):
    classes = output.shape[-1]  # class last, as transformers emit [B, T, C]
    if not label.dtype.is_floating_point:  # torch takes int64 (or uint8) class indices only
        label = label.long()
    per = F.cross_entropy(output.reshape(-1, classes), label.reshape(-1), reduction="none",
                          ignore_index=IGNORE_INDEX)
    return per.reshape(label.shape), label != IGNORE_INDEX


def _elementwise(fn: Callable) -> Callable:
    """A loss of same-shaped output and label, the label cast to the output's dtype (integer
    and boolean labels are 0/1 targets or values)."""
    def loss(output: torch.Tensor, label: torch.Tensor):
        return fn(output, label.to(output.dtype), reduction="none"), None
    return loss


_BUILT_IN = {
    "cross_entropy": _cross_entropy,
    "bce_with_logits": _elementwise(F.binary_cross_entropy_with_logits),
    "mse": _elementwise(F.mse_loss),
    "l1": _elementwise(F.l1_loss),
    "huber": _elementwise(F.huber_loss),  # delta 1.0, torch's default
}
LOSSES = tuple(_BUILT_IN)
"""The built-in losses, by name."""
CLASSIFYING = frozenset({"cross_entropy", "bce_with_logits"})
"""The built-in losses whose outputs are scored for accuracy."""


def shape_problem(name: str, output: torch.Tensor, label: torch.Tensor) -> str | None:
    """Why built-in loss `name` cannot pair `output` with `label`, or None."""
    if name == "cross_entropy":
        if output.dim() == label.dim() + 1 and output.shape[:-1] == label.shape:
            return None
        return (f"cross_entropy needs outputs of the labels' shape plus a last dimension of "
                f"classes, {(*label.shape, 'C')}; got {tuple(output.shape)} for labels of "
                f"shape {tuple(label.shape)}")
    if _aligned(output, label).shape == label.shape:
        return None
    return (f"{name} needs outputs of the labels' shape {tuple(label.shape)}"
            f"{' (or with a last dimension of 1)' if label.dim() == 1 else ''}; got "
            f"{tuple(output.shape)}")


def _aligned(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """[B, 1] outputs for [B] labels (a regression's or a binary classifier's one unit) as
    [B]; nothing else is broadcast (mse of [B] and [B, 1] would silently be [B, B])."""
    if output.dim() == label.dim() + 1 and output.shape[-1] == 1:
        return output.squeeze(-1)
    return output


def _kept_sums(name: str, output: torch.Tensor, label: torch.Tensor,
               weights: torch.Tensor | None, exact: bool):
    """(sum of w * l, sum of w) over the kept elements of built-in loss `name`; `exact`:
    reduce in float64 (evaluation), else in the output's dtype (half types in float32)."""
    if name != "cross_entropy":
        output = _aligned(output, label)
    problem = shape_problem(name, output, label)
    if problem:
        raise ModelError(problem)
    per, keep = _BUILT_IN[name](output, label)
    if exact:
        per = per.double()
    elif per.dtype in (torch.float16, torch.bfloat16):
        per = per.float()
    if weights is None and keep is None:  # torch.full: no copy from the host to the device
        return per.sum(), torch.full((), float(per.numel()), dtype=per.dtype, device=per.device)
    w = keep.to(per.dtype) if keep is not None else None
    if weights is not None:  # a row's weight over each of its elements
        rows = weights.to(per.dtype).reshape(-1, *(1,) * (per.dim() - 1)).expand_as(per)
        w = rows if w is None else rows * w
    return (w * per).sum(), w.sum()


def _hits(name: str, output: torch.Tensor, label: torch.Tensor):
    """(correct, scored) of a classifying output: cross_entropy's argmax at the kept positions,
    bce_with_logits per element (logit > 0 against label > 0.5)."""
    if name == "cross_entropy":
        keep = label != IGNORE_INDEX
        return ((output.argmax(dim=-1) == label) & keep).sum(), keep.sum()
    label = label.to(torch.float32) if label.dtype == torch.bool else label
    hits = ((_aligned(output, label) > 0) == (label > 0.5)).sum()
    return hits, torch.full((), label.numel(), dtype=hits.dtype, device=hits.device)


def _safe_div(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den, and 0 where nothing is kept (den 0, so num 0), without NaN in the gradient."""
    return num / torch.where(den > 0, den, torch.ones_like(den))


@dataclass(frozen=True, slots=True)
class EvalSums:
    """One chunk's evaluation, on the device (added up without a host sync). For one output,
    sum(loss_sum) / sum(loss_weight) over chunks is the weighted mean over all kept elements;
    with several, each chunk's objective weighted by its first output's kept weight."""

    loss_sum: torch.Tensor
    loss_weight: torch.Tensor
    correct: torch.Tensor | None
    scored: torch.Tensor | None

    def __add__(self, other: EvalSums) -> EvalSums:
        def add(a, b):
            return None if a is None else a + b
        return EvalSums(self.loss_sum + other.loss_sum, self.loss_weight + other.loss_weight,
                        add(self.correct, other.correct), add(self.scored, other.scored))


@dataclass(frozen=True, slots=True)
class Objective:
    """What training minimises and evaluation reports; built by `make_objective`."""

    losses: tuple[str | LossFn, ...]
    """One per output; or one callable given every output (`joint`)."""
    loss_weights: tuple[float, ...]
    num_outputs: int = 1
    weighted: bool = False
    """The fit has a weight column: callables get the weights as a third argument."""
    metrics: tuple = ()
    """`fit(metrics=)`, checked (`_metrics.make_metrics`): what evaluation reports besides."""

    @property
    def joint(self) -> bool:
        return len(self.losses) != self.num_outputs

    @property
    def model_loss(self) -> bool:
        """`loss="model"`: the model computes the loss from `labels=` (`_model_output`)."""
        return self.losses == (MODEL_LOSS,)

    def model_labels(self, labels: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """What forward gets as `labels=`: the label column under `loss="model"`, else
        nothing."""
        return labels[0] if self.model_loss else None

    @property
    def classify(self) -> bool:
        """Some output is scored for accuracy."""
        return any(loss in CLASSIFYING for loss in self.losses if isinstance(loss, str))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(loss if isinstance(loss, str) else getattr(loss, "__name__", "callable")
                     for loss in self.losses)

    def __call__(self, outputs, labels: Sequence[torch.Tensor],
                 weights: torch.Tensor | None = None) -> torch.Tensor:
        """The scalar (differentiable) loss of a batch: outputs a tensor, or a tuple of one
        per label."""
        return sum(lw * mean for lw, (_, _, mean) in
                   zip(self.loss_weights, self._terms(outputs, labels, weights, False),
                       strict=True))

    def unweighted(self, output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        """The loss of one output and one label tensor, every row weighing 1."""
        return self(output, (label,), None)

    def step_weight(self, labels: Sequence[torch.Tensor],
                    weights: torch.Tensor | None = None) -> torch.Tensor:
        """What a micro-batch weighs among an optimizer step's several (gradient
        accumulation): its first output's kept weight (built-in losses: the elements kept,
        each with its row's weight), else its rows' weight. Weighing by it makes a step of
        several micro-batches the weighted mean over all their kept elements, as one batch of
        them would be, when -100 positions or weights differ between micro-batches."""
        label = labels[0]
        rows = label.shape[0]
        loss = self.losses[0]
        if isinstance(loss, str) and loss != MODEL_LOSS and not self.joint:
            keep = (label != IGNORE_INDEX) if loss == "cross_entropy" else None
            per_row = label[0].numel() if rows else 1
            if weights is None:
                kept = keep.sum() if keep is not None else torch.full(
                    (), float(rows * per_row), device=label.device)
                return kept.double()
            w = weights.double().reshape(-1, *(1,) * (label.dim() - 1))
            if keep is not None:
                return (w * keep).sum()
            return w.sum() * per_row
        if weights is not None:
            return weights.double().sum()
        return torch.full((), float(rows), dtype=torch.float64, device=label.device)

    def evaluate(self, outputs, labels: Sequence[torch.Tensor],
                 weights: torch.Tensor | None = None) -> EvalSums:
        """A chunk's sums: loss_sum is the objective times loss_weight, the first output's
        kept weight (a first built-in output's weighted loss sum exactly), in float64."""
        terms = self._terms(outputs, labels, weights, True)
        first_num, weight, first_mean = terms[0]
        if first_num is None:  # a callable or the model's loss: its rows' weight
            rows = labels[0].shape[0]
            empty = weight  # the model's loss: a chunk with nothing left weighs 0
            weight = weights.double().sum() if weights is not None else torch.full(
                (), float(rows), dtype=torch.float64, device=first_mean.device)
            if empty is not None:
                weight = torch.where(empty, torch.zeros_like(weight), weight)
            first_num = first_mean.double() * weight
        loss_sum = self.loss_weights[0] * first_num
        for lw, (_, _, mean) in zip(self.loss_weights[1:], terms[1:], strict=True):
            loss_sum = loss_sum + lw * mean.double() * weight
        correct = scored = None
        if self.classify:
            for loss, out, label in zip(self.losses, as_tuple(outputs), labels,
                                        strict=True):
                if isinstance(loss, str) and loss in CLASSIFYING:
                    hits, count = _hits(loss, out, label)
                    correct = hits if correct is None else correct + hits
                    scored = count if scored is None else scored + count
        return EvalSums(loss_sum, weight, correct, scored)

    def _terms(self, outputs, labels, weights, exact: bool) -> list[tuple]:
        """Per loss: (weighted sum, kept weight, mean); (None, None, value) for a callable;
        (None, whether the chunk had nothing to learn, value) for the model's own loss."""
        if self.model_loss:
            return [model_loss_term(outputs, labels[0])]
        if self.joint:
            return [self._user(self.losses[0], as_tuple(outputs), tuple(labels), weights)]
        terms = []
        for loss, out, label in zip(self.losses, as_tuple(outputs), labels, strict=True):
            if callable(loss):
                terms.append(self._user(loss, out, label, weights))
            else:
                num, den = _kept_sums(loss, out, label, weights, exact)
                terms.append((num, den, _safe_div(num, den)))
        return terms

    def _user(self, loss: LossFn, output, label, weights) -> tuple:
        value = loss(output, label, weights) if self.weighted else loss(output, label)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise ModelError(f"the loss callable {getattr(loss, '__name__', loss)!r} must "
                             f"return a scalar tensor, got {describe(value)}")
        return None, None, value.reshape(())


def make_objective(loss, *, loss_weights=None, num_outputs: int = 1,
                   weighted: bool = False, inputs=None) -> Objective:
    """The objective of `fit(loss=, loss_weights=)` for a model of `num_outputs` outputs (one
    per label column); `weighted`: the fit has a weight column.

    `loss`: a name in LOSSES, a callable, or a list of them with one per output. A callable
    is called as `loss(output, label)`, or `loss(output, label, weights)` (the rows' weights,
    `[B]`) when `weighted`, and returns a scalar tensor; a single callable for several outputs
    gets the tuple of outputs and the tuple of labels (and the weights), and weighs them
    itself. `loss_weights`: one finite number >= 0 per output, default all 1. "model": the
    model's own loss, given the one label column as `labels=` (`inputs`: the fit's, which
    must bind by name; `_model_output.check_model_loss`).

    Refuses (ConfigError, naming the argument) a name not in LOSSES, a single name for several
    outputs, a list of the wrong length, and bad loss_weights."""
    if isinstance(loss, str) and loss == MODEL_LOSS:
        check_model_loss(num_outputs=num_outputs, loss_weights=loss_weights,
                         weighted=weighted, inputs=inputs)
        return Objective((MODEL_LOSS,), (1.0,))
    if isinstance(loss, (list, tuple)):
        if len(loss) != num_outputs:
            raise ConfigError(f"loss lists {len(loss)} loss{'es' if len(loss) != 1 else ''} "
                              f"for {_outputs(num_outputs)}: give one loss per label column")
        losses = tuple(_checked_loss(item, f"loss[{k}]") for k, item in enumerate(loss))
    else:
        losses = (_checked_loss(loss, "loss"),)
        if num_outputs > 1 and isinstance(loss, str):
            raise ConfigError(
                f"loss={loss!r} names one loss for {_outputs(num_outputs)}: give one loss "
                f"per label column, e.g. loss={[loss] * num_outputs!r}")
    joint = len(losses) != num_outputs
    return Objective(losses, _checked_weights(loss_weights, num_outputs, joint), num_outputs,
                     bool(weighted))


def make_loss(loss: str | LossFn) -> tuple[LossFn, bool]:
    """`loss(output, label)` of one output, every row weighing 1, and whether accuracy is
    reported: for callers that know neither weights nor several outputs."""
    objective = make_objective(loss)
    return objective.unweighted, objective.classify


def _checked_loss(loss, name: str) -> str | LossFn:
    if callable(loss):
        return loss
    if isinstance(loss, str) and loss == MODEL_LOSS:
        if name != "loss":
            raise ConfigError(f"{name}='model': the model's own loss is the whole objective; "
                              "it cannot be one of a list of losses")
        return loss
    if isinstance(loss, str) and loss in _BUILT_IN:
        return loss
    if isinstance(loss, str):
        raise ConfigError(f"{name}={loss!r} is not supported; use one of "
                          f"{', '.join(map(repr, LOSSES))}, 'model' or a callable")
    raise ConfigError(f"{name} must be a loss name ({', '.join(map(repr, LOSSES))}), a "
                      f"callable or a list of them (one per output), got {describe(loss)}")


def _checked_weights(loss_weights, num_outputs: int, joint: bool) -> tuple[float, ...]:
    if loss_weights is None:
        return (1.0,) * (1 if joint else num_outputs)
    if joint:
        raise ConfigError("loss_weights weigh a list of losses, one per output; the single "
                          "callable loss gets every output and weighs them itself")
    if not isinstance(loss_weights, (list, tuple)) or len(loss_weights) != num_outputs:
        raise ConfigError(f"loss_weights must be a list of {num_outputs} numbers, one per "
                          f"output, got {loss_weights!r}"[:300])
    for k, value in enumerate(loss_weights):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) \
                or not math.isfinite(value) or value < 0:
            raise ConfigError(f"loss_weights[{k}]={value!r} must be a finite number >= 0")
    if not any(loss_weights):
        raise ConfigError("loss_weights are all 0: nothing would be trained")
    return tuple(float(value) for value in loss_weights)


def _outputs(count: int) -> str:
    return "1 output" if count == 1 else f"{count} outputs"


def check_outputs(objective: Objective, outputs, labels: Sequence[torch.Tensor],
                  label_names: Sequence[str]) -> None:
    """The driver's probe: the model's `outputs` on a probe batch against that batch's
    `labels` (integer ones holding their column's least and greatest value). A ModelError
    names the label column and the shapes when they cannot pair, or when the loss fails;
    under `loss="model"`, when the output has no scalar `.loss`."""
    names = ", ".join(map(repr, label_names))
    if objective.model_loss:
        loss_of(outputs)
        return
    outs = output_tensors(outputs, objective.num_outputs, names)
    if not objective.joint:
        for loss, out, label, name in zip(objective.losses, outs, labels, label_names,
                                          strict=True):
            if isinstance(loss, str):
                _check_built_in(loss, out, label, name)
    weights = None
    if objective.weighted:
        weights = torch.ones(labels[0].shape[0], dtype=outs[0].dtype, device=outs[0].device)
    try:
        objective(outputs, labels, weights)
    except Exception as exc:
        raise ModelError(f"the loss fails on the model's outputs "
                         f"{[tuple(o.shape) for o in outs]} for label column(s) {names} of "
                         f"shape(s) {[tuple(y.shape) for y in labels]}: {exc!r}"[:1000]) from exc


def _check_built_in(loss: str, output: torch.Tensor, label: torch.Tensor, name: str) -> None:
    aligned = output if loss == "cross_entropy" else _aligned(output, label)
    problem = shape_problem(loss, aligned, label)
    if problem:
        raise ModelError(f"label column {name!r}: {problem}")
    if loss != "cross_entropy":
        return
    if label.dtype.is_floating_point or label.dtype == torch.bool:
        raise ModelError(f"label column {name!r} holds {label.dtype}: cross_entropy needs "
                         "integer class labels")
    classes, kept = output.shape[-1], label[label != IGNORE_INDEX]
    if kept.numel() and (int(kept.min()) < 0 or int(kept.max()) >= classes):
        raise ModelError(
            f"label column {name!r}: labels range from {int(kept.min())} to "
            f"{int(kept.max())} but the model outputs {classes} classes: cross_entropy needs "
            f"labels in [0, {classes - 1}] (or {IGNORE_INDEX} for a position to ignore)")
