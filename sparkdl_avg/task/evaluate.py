"""Loss (and, for classifiers, correct predictions) of a model over a task's evaluation rows,
a chunk of `TrainConfig.eval_rows` at a time (from either data cache). Both modes evaluate in
the tasks."""

from __future__ import annotations

import math


def evaluate_batches(model, batches, objective, call) -> dict:
    """{"loss_sum", "loss_weight", "correct", "scored" (both None unless the objective
    classifies), "count" (rows), "metrics", "tables" (`_metrics.Accumulator.result`)} over
    `batches`: items with `.inputs`, `.labels`, `.weights` and `.rows`, run as
    `call(model, inputs)`, or `call(model, inputs, labels)` under loss="model" (the
    objective's `model_labels`). The sums add up across chunks and workers: sum(loss_sum) /
    sum(loss_weight) is the eval loss, sum(correct) / sum(scored) the accuracy; the metrics'
    statistics merge by `_eval_sums.merge`. Each module's training mode is left as it was."""
    import torch

    from sparkdl_avg._metrics import Accumulator
    from sparkdl_avg._model import evaluating
    from sparkdl_avg._model_output import logits_of

    totals = None  # summed on the device: one host sync at the end, not one a chunk
    metrics = Accumulator(getattr(objective, "metrics", ()))
    count = 0
    with evaluating(model), torch.no_grad():
        for batch in batches:
            labels = objective.model_labels(batch.labels)
            out = call(model, batch.inputs) if labels is None else \
                call(model, batch.inputs, labels)
            sums = objective.evaluate(out, batch.labels, batch.weights)
            totals = sums if totals is None else totals + sums
            if metrics.metrics:
                metrics.add(logits_of(out), batch.labels, batch.weights)
            count += int(batch.rows)
    metric_sums, tables = metrics.result()
    if totals is None:  # no evaluation rows: the worker still answers
        scored = 0 if objective.classify else None
        return {"loss_sum": 0.0, "loss_weight": 0.0, "correct": scored, "scored": scored,
                "count": 0, "metrics": metric_sums, "tables": tables}
    parts = [totals.loss_sum, totals.loss_weight]
    if totals.correct is not None:
        parts += [totals.correct, totals.scored]
    values = torch.stack([p.double() for p in parts]).tolist()  # counts exact below 2**53
    correct, scored = (int(values[2]), int(values[3])) if len(values) > 2 else (None, None)
    return {"loss_sum": values[0], "loss_weight": values[1], "correct": correct,
            "scored": scored, "count": count, "metrics": metric_sums, "tables": tables}


def eval_means(loss_sum: float | None, loss_weight: float, correct: int | None,
               scored: int | None) -> tuple[float, float | None]:
    """(eval_loss, eval_accuracy or None) from sums over chunks and workers: the loss NaN when
    some part was not finite, 0 when nothing was kept, as in training."""
    loss = math.nan if loss_sum is None else loss_sum / (loss_weight if loss_weight > 0 else 1)
    accuracy = None if correct is None else correct / max(1, scored)
    return loss, accuracy


def eval_metrics(result: dict, metrics=()) -> dict[str, float]:
    """What an evaluation logs, from its workers' merged sums (`_eval_sums.merge`):
    eval_loss, eval_accuracy (classifiers), eval_<name> for each of `metrics`
    (`_metrics.final_values`) and time_eval_s (the slowest worker's)."""
    from sparkdl_avg._metrics import final_values

    loss, accuracy = eval_means(result["loss_sum"], result["loss_weight"], result["correct"],
                                result["scored"])
    out = {"eval_loss": loss}
    if accuracy is not None:  # classifiers only
        out["eval_accuracy"] = accuracy
    out.update(final_values(metrics, result.get("metrics")))
    out["time_eval_s"] = result["eval_s"]
    return out
