"""Evaluation metrics beyond the loss and accuracy (`fit(metrics=)`), exact over chunks and
workers: the built-in "auc" and "perplexity", and the user's (`Metric`, or a callable
returning a numerator and a denominator).

Each metric is statistics that merge exactly, then a final function of the merged ones.
perplexity's are the token cross-entropy's weighted sum and weight (exp of their ratio); a
`Metric`'s are numbers that add; auc's is a score table (`_eval_sums`), merged by score and
reduced to the Mann-Whitney sums. A chunk's statistics stay on the device and are added
there; the worker moves them to the host once (`Accumulator.result`), and the drivers merge
the workers' (`_eval_sums.merge`) and finalize them here (`final_values`). torch is imported
only where a metric runs, so `Metric` is importable without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from sparkdl_avg._errors import ConfigError, DataError, ModelError, TrainingError
from sparkdl_avg.net.fields import MAX_METRIC_SUMS, MAX_METRICS, MAX_TABLE_ROWS, METRIC_NAME

BUILT_IN = ("auc", "perplexity")
"""The metrics `fit(metrics=)` knows by name."""
RANKING = frozenset({"auc"})
"""The metrics whose statistics are score tables, not sums."""
_RESERVED = ("loss", "accuracy")
_AUC_LOSSES = ("bce_with_logits", "cross_entropy", "model")


@dataclass(frozen=True)
class Metric:
    """A custom evaluation metric, exact over evaluation chunks and workers, logged as
    `eval_<name>` at every evaluation.

    `sums(output, label, weights)` gets a chunk's model output (its logits; a tuple with
    several outputs), its label tensor (a tuple with several label columns) and its rows'
    weights (`[B]`, or None without `weight_col`), and returns the chunk's statistics:
    numbers that *add* over chunks and workers (scalar tensors, floats, or one 1-D tensor; at
    most 64, the same count every chunk). `finalize(totals)` turns their totals (a float64
    numpy array) into the metric; None: `sums` returns (numerator, denominator) and the metric
    is their ratio. A plain callable given to `fit(metrics=)` is `Metric(fn.__name__, fn)`."""

    name: str
    sums: Callable
    finalize: Callable[[np.ndarray], float] | None = None


def make_metrics(metrics, objective) -> tuple[str | Metric, ...]:
    """`fit(metrics=)` checked against the fit's objective: names in BUILT_IN, `Metric`s and
    callables, each name once. ConfigError naming what is wrong, before any Spark job."""
    if metrics is None:
        return ()
    items = list(metrics) if isinstance(metrics, (list, tuple)) else [metrics]
    out: list[str | Metric] = []
    for item in items:
        if isinstance(item, str):
            if item not in BUILT_IN:
                raise ConfigError(f"metrics: {item!r} is not a known metric; use one of "
                                  f"{', '.join(map(repr, BUILT_IN))}, a Metric or a callable "
                                  "returning (numerator, denominator)")
            _check_applies(item, objective)
            out.append(item)
        elif isinstance(item, Metric):
            _check_custom(item)
            out.append(item)
        elif callable(item):
            out.append(_check_custom(Metric(getattr(item, "__name__", ""), item)))
        else:
            raise ConfigError(f"metrics must hold metric names ({', '.join(BUILT_IN)}), "
                              f"Metrics or callables, got {type(item).__name__}")
    names = [name_of(m) for m in out]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"metrics names {name!r} twice: each is logged as eval_{name}")
    if len(out) > MAX_METRICS:
        raise ConfigError(f"metrics lists {len(out)} metrics; at most {MAX_METRICS}")
    return tuple(out)


def name_of(metric: str | Metric) -> str:
    return metric if isinstance(metric, str) else metric.name


def _check_custom(metric: Metric) -> Metric:
    name = metric.name
    if not isinstance(name, str) or not METRIC_NAME.fullmatch(name) or name in _RESERVED \
            or name in BUILT_IN:
        raise ConfigError(
            f"metrics: a custom metric needs a name of letters, digits and _ (at most 40, a "
            f"letter first), other than {', '.join(_RESERVED + BUILT_IN)}, logged as "
            f"eval_<name>; got {name!r}: name it with Metric('my_name', fn)")
    if not callable(metric.sums) or not (metric.finalize is None or callable(metric.finalize)):
        raise ConfigError(f"Metric {name!r}: sums must be a callable (output, label, weights) "
                          "-> numbers, finalize a callable totals -> float or None")
    return metric


def _check_applies(name: str, objective) -> None:
    loss = objective.names[0] if len(objective.names) == 1 else None
    given = "loss=" + repr(list(objective.names) if loss is None else loss)
    if objective.num_outputs != 1 or objective.joint:
        raise ConfigError(f"metrics=[{name!r}] scores a fit of one output (one label column); "
                          f"this fit has {objective.num_outputs} ({given})")
    if name == "auc" and loss not in _AUC_LOSSES:
        raise ConfigError(f"metrics=['auc'] needs a binary classifier: loss='bce_with_logits' "
                          f"(one logit per row), loss='cross_entropy' with two classes, or "
                          f"loss='model' with either; the fit has {given}")
    if name == "perplexity" and loss != "cross_entropy":
        why = (": the model's own loss is a mean per chunk whose token count the fit cannot "
               "see; use loss='cross_entropy' on the logits, with the labels shifted and "
               "padded with -100 (see docs/guide/fine-tuning.md)") if loss == "model" else ""
        raise ConfigError(f"metrics=['perplexity'] is exp of the token cross entropy and "
                          f"needs loss='cross_entropy'; the fit has {given}{why}")


def check_table_rows(metrics, eval_rows: int) -> None:
    """A ranking metric keeps every distinct score: DataError when eval_df has more rows than
    the score tables may carry (`MAX_TABLE_ROWS`)."""
    ranking = [name_of(m) for m in metrics if name_of(m) in RANKING]
    if ranking and eval_rows > MAX_TABLE_ROWS:
        raise DataError(f"eval_df has {eval_rows} rows; metrics={ranking} is exact and keeps "
                        f"every distinct score (24 bytes a row on the driver or the parameter "
                        f"server), for at most {MAX_TABLE_ROWS} rows: evaluate on a sample "
                        f"(eval_df.sample(fraction=..., seed=...))")


def _auc_pairs(output, label):
    """(score, positive, kept) per row of a binary classifier: one logit a row ([B] or
    [B, 1], positive: label > 0.5), or two classes' logits ([B, 2] for integer labels [B],
    score the logit difference, which ranks as class 1's probability; -100 not kept)."""
    import torch

    from sparkdl_avg.data.schema import IGNORE_INDEX

    rows = label.shape[0]
    flat_label = label.reshape(rows, -1)
    if flat_label.shape[1] != 1:
        raise ModelError(f"metrics=['auc'] needs one label value per row; the labels have "
                         f"shape {tuple(label.shape)}")
    flat_label = flat_label[:, 0]
    if output.dim() in (1, 2) and output.shape[0] == rows and output.numel() == rows:
        positive = flat_label.to(torch.float32) > 0.5 if flat_label.dtype == torch.bool \
            else flat_label > 0.5
        return output.reshape(rows), positive, None
    if output.dim() == 2 and output.shape == (rows, 2) and not flat_label.is_floating_point():
        return output[:, 1] - output[:, 0], flat_label == 1, flat_label != IGNORE_INDEX
    raise ModelError(f"metrics=['auc'] needs one logit per row ([B] or [B, 1]) or two "
                     f"classes' logits ([B, 2] with integer labels); the model outputs "
                     f"{tuple(output.shape)} for labels of shape {tuple(label.shape)}")


def _custom_sums(metric: Metric, output, label, weights):
    import torch

    try:
        value = metric.sums(output, label, weights)
        if isinstance(value, torch.Tensor):
            parts = value.detach().reshape(-1).double()
        else:
            parts = [v.detach().reshape(()).double() if isinstance(v, torch.Tensor)
                     else torch.tensor(float(v), dtype=torch.float64) for v in value]
            device = next((p.device for p in parts if p.device.type != "cpu"), None)
            parts = torch.stack([p.to(device) if device else p for p in parts])
    except Exception as exc:
        raise ModelError(f"metric {metric.name!r}: sums(output, label, weights) must return "
                         f"numbers that add (scalar tensors or floats, or a 1-D tensor); it "
                         f"raised or returned something else: {exc!r}"[:600]) from exc
    count = parts.numel()
    if not 1 <= count <= MAX_METRIC_SUMS or (metric.finalize is None and count != 2):
        need = "2 (numerator, denominator)" if metric.finalize is None \
            else f"1 to {MAX_METRIC_SUMS}"
        raise ModelError(f"metric {metric.name!r}: sums returned {count} numbers; it must "
                         f"return {need}")
    return parts


class Accumulator:
    """A worker's metric statistics over its evaluation chunks, kept on the device."""

    def __init__(self, metrics: Sequence[str | Metric]) -> None:
        self.metrics = tuple(metrics)
        self._sums: dict[str, object] = {}
        self._pairs: dict[str, list] = {m: [] for m in self.metrics if m in RANKING}

    def add(self, output, labels, weights) -> None:
        """A chunk: `output` the model's logits (a tuple with several outputs), `labels` the
        chunk's label tensors, `weights` its rows' weights or None."""
        import torch

        from sparkdl_avg._losses import _kept_sums

        for metric in self.metrics:
            if metric == "auc":
                score, positive, kept = _auc_pairs(output, labels[0])
                weight = weights.double() if weights is not None else torch.ones_like(
                    score, dtype=torch.float64)
                if kept is not None:
                    weight = torch.where(kept, weight, torch.zeros_like(weight))
                self._pairs[metric].append((score.detach().double(), positive, weight))
                continue
            if metric == "perplexity":
                num, den = _kept_sums("cross_entropy", output, labels[0], weights, True)
                parts = torch.stack([num, den])
            else:
                single = len(labels) == 1
                parts = _custom_sums(metric, output, labels[0] if single else tuple(labels),
                                     weights)
            name = name_of(metric)
            before = self._sums.get(name)
            if before is not None and before.numel() != parts.numel():
                raise ModelError(f"metric {name!r}: sums returned {parts.numel()} numbers "
                                 f"for a chunk after {before.numel()} for the one before")
            self._sums[name] = parts if before is None else before + parts.to(before.device)

    def result(self) -> tuple[dict, dict]:
        """(metrics: {name: sums, None where not finite, [] without evaluation rows},
        tables: {name: score table}), moved to the host."""
        import torch

        from sparkdl_avg._eval_sums import table_of

        metrics: dict[str, list[float] | None] = {}
        for metric in self.metrics:
            parts = self._sums.get(name_of(metric))
            if metric in RANKING:
                continue
            values = [] if parts is None else parts.tolist()
            metrics[name_of(metric)] = values if all(map(math.isfinite, values)) else None
        tables = {}
        for name, pairs in self._pairs.items():
            if not pairs:
                tables[name] = table_of(np.zeros(0), np.zeros(0, bool), np.zeros(0))
                continue
            score, positive, weight = (torch.cat(part).cpu().numpy()
                                       for part in zip(*pairs, strict=True))
            keep = weight > 0
            score, positive, weight = score[keep], positive[keep], weight[keep]
            if not np.isfinite(score).all():
                metrics[name] = None  # a diverged model: the metric is NaN
                continue
            tables[name] = table_of(score, positive, weight)
        return metrics, tables


def final_values(metrics: Sequence[str | Metric], sums: dict | None) -> dict[str, float]:
    """{"eval_<name>": value} from the merged sums of a complete evaluation; NaN where a
    worker's were not finite, or the metric is undefined (auc with one class only)."""
    out = {}
    for metric in metrics:
        name = name_of(metric)
        totals = (sums or {}).get(name)
        out[f"eval_{name}"] = math.nan if totals is None else _final(metric, totals)
    return out


def _final(metric: str | Metric, totals: list[float]) -> float:
    if not totals:  # no worker had evaluation rows
        return math.nan
    if metric == "auc":
        u, positives, negatives = totals
        return u / (positives * negatives) if positives > 0 and negatives > 0 else math.nan
    if metric == "perplexity":
        loss_sum, weight = totals
        if weight <= 0:
            return math.nan
        try:
            return math.exp(loss_sum / weight)
        except OverflowError:
            return math.inf
    if metric.finalize is None:
        numerator, denominator = totals
        return numerator / denominator if denominator else math.nan
    try:
        return float(metric.finalize(np.asarray(totals, np.float64)))
    except Exception as exc:
        raise TrainingError(f"metric {metric.name!r}: finalize(totals) raised on totals "
                            f"{totals!r}: {exc!r}"[:600]) from exc


def check_metrics(metrics: Sequence[str | Metric], outputs, labels, weights=None) -> None:
    """The driver's probe: every metric once on the probe batch's outputs, and each custom
    one's finalize on that batch's sums, so that a metric that cannot score this model fails
    (ModelError) before training."""
    if not metrics:
        return
    accumulator = Accumulator(metrics)
    accumulator.add(outputs, labels, weights)
    sums, tables = accumulator.result()
    for metric in metrics:
        if isinstance(metric, Metric) and metric.finalize is not None and \
                sums.get(metric.name) is not None:
            try:
                float(metric.finalize(np.asarray(sums[metric.name], np.float64)))
            except Exception as exc:
                raise ModelError(f"metric {metric.name!r}: finalize(totals) must return a "
                                 f"number; on the probe batch's sums it raised {exc!r}"[:600]
                                 ) from exc
