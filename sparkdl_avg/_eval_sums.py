"""A worker's evaluation as sums that merge exactly over workers, in numpy alone (the parameter
server merges them too, and imports neither torch nor pyspark).

A worker's part: the loss's and accuracy's sums (`_losses.EvalSums`), its row count and time,
and each metric's (`_metrics`) statistics: a list of numbers that add (None where one was not
finite), or for a ranking metric (auc) a *score table*: one row (score, positive weight,
negative weight) per distinct score, sorted by score. Tables merge by score (`merge_tables`);
a merged table reduces to three sums, the Mann-Whitney statistic with ties counted half and
the two classes' weights (`mann_whitney`). So a complete result holds plain sums for every
metric, and the driver finalizes them (`_metrics.final_values`) the same way in both modes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from sparkdl_avg._errors import ProtocolError
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.fields import MAX_TABLE_ROWS, TABLE_COLUMNS

__all__ = ["MAX_TABLE_ROWS", "eval_message", "mann_whitney", "merge", "merge_tables",
           "payload_target", "received_part", "split_tables", "table_of"]


def table_of(scores: np.ndarray, positive: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """The score table of scored elements: per distinct score (ascending), the summed weight
    of the positives and of the negatives holding it; float64 [K, 3]."""
    if scores.size == 0:
        return np.zeros((0, TABLE_COLUMNS))
    distinct, at = np.unique(scores.astype(np.float64, copy=False), return_inverse=True)
    weight = weight.astype(np.float64, copy=False)
    table = np.empty((distinct.size, TABLE_COLUMNS))
    table[:, 0] = distinct
    table[:, 1] = np.bincount(at, weights=np.where(positive, weight, 0.0),
                              minlength=distinct.size)
    table[:, 2] = np.bincount(at, weights=np.where(positive, 0.0, weight),
                              minlength=distinct.size)
    return table


def merge_tables(tables: Sequence[np.ndarray]) -> np.ndarray:
    """One table from several: the rows of a score present in several tables added."""
    tables = [t for t in tables if t.size]
    if not tables:
        return np.zeros((0, TABLE_COLUMNS))
    if len(tables) == 1:
        return tables[0]
    return _summed_rows(np.concatenate(tables))


def _summed_rows(rows: np.ndarray) -> np.ndarray:
    distinct, at = np.unique(rows[:, 0], return_inverse=True)
    table = np.empty((distinct.size, TABLE_COLUMNS))
    table[:, 0] = distinct
    table[:, 1] = np.bincount(at, weights=rows[:, 1], minlength=distinct.size)
    table[:, 2] = np.bincount(at, weights=rows[:, 2], minlength=distinct.size)
    return table


def mann_whitney(table: np.ndarray) -> list[float]:
    """[U, P, N] of a merged table: U the weight of (positive, negative) pairs the score ranks
    right, a tie counting half; P and N the positives' and negatives' weights. The AUC is
    U / (P * N) (sklearn's roc_auc_score, ties included)."""
    if table.size == 0:
        return [0.0, 0.0, 0.0]
    positives, negatives = table[:, 1], table[:, 2]
    below = np.cumsum(negatives) - negatives  # negatives scored strictly lower
    u = float(np.dot(positives, below + negatives / 2))
    return [u, float(positives.sum()), float(negatives.sum())]


def split_tables(ranked: dict[str, int] | None, payload) -> dict[str, np.ndarray]:
    """The score tables an EVAL carries (`ranked`: rows per metric, in payload order), checked:
    finite scores strictly ascending, weights finite and >= 0. ProtocolError otherwise."""
    total = sum((ranked or {}).values())
    size = 0 if payload is None else len(memoryview(payload).cast("B"))
    if size != total * TABLE_COLUMNS * 8:
        raise ProtocolError(f"malformed Eval: {total} score-table rows need "
                            f"{total * TABLE_COLUMNS * 8} payload bytes, got {size}")
    if not total:
        return {}
    rows = np.frombuffer(payload, np.float64).reshape(total, TABLE_COLUMNS)
    if not np.isfinite(rows).all() or (rows[:, 1:] < 0).any():
        raise ProtocolError("malformed Eval: a score table holds NaN, Inf or a negative weight")
    out, start = {}, 0
    for name, count in ranked.items():
        table = rows[start:start + count]
        if count > 1 and not (np.diff(table[:, 0]) > 0).all():
            raise ProtocolError(f"malformed Eval: the score table of {name!r} is not sorted "
                                "by distinct scores")
        out[name], start = table, start + count
    return out


def eval_message(result: dict, eval_s: float, request: int | None = None):
    """(the EVAL, its payload or None) of a worker's evaluation (`task.evaluate`): the score
    tables travel as the payload, rows of float64, in the order `ranked` names them."""
    tables = result.get("tables") or {}
    loss = result["loss_sum"]
    message = msg.Eval(
        loss_sum=loss if loss is not None and math.isfinite(loss) else None,
        loss_weight=result["loss_weight"], correct=result["correct"], scored=result["scored"],
        count=result["count"], eval_s=eval_s, request=request,
        metrics=result.get("metrics") or None,
        ranked={name: len(t) for name, t in tables.items()} or None)
    payload = np.concatenate([t.reshape(-1) for t in tables.values()]) \
        if any(t.size for t in tables.values()) else None
    return message, payload


def received_part(message, payload) -> dict:
    """A worker's part for `merge` from its EVAL and payload (checked: `split_tables`)."""
    return {"loss_sum": message.loss_sum, "loss_weight": message.loss_weight,
            "correct": message.correct, "scored": message.scored, "count": message.count,
            "eval_s": message.eval_s, "metrics": message.metrics,
            "tables": split_tables(message.ranked, payload)}


def payload_target(message) -> np.ndarray | None:
    """Where an EVAL's payload goes: an array of exactly the bytes its `ranked` rows take
    (bounded by the message's own check), so a payload of another size is refused unread."""
    rows = sum((message.ranked or {}).values())
    return np.empty(rows * TABLE_COLUMNS, np.float64)


def _finite_sum(values: list[float | None]) -> float | None:
    if None in values:
        return None
    total = math.fsum(values)
    return total if math.isfinite(total) else None


def merge(parts: Sequence[dict]) -> dict:
    """One result from every worker's part {loss_sum, loss_weight, correct, scored, count,
    eval_s, metrics?, tables?}: sums added, a non-finite loss (None) anywhere making the loss
    None, and so finite sums that overflow (the weight then 0: the result stays finite JSON);
    eval_s the slowest worker's. Metrics: each one's sums added element by element (None when
    any is None or the total is not finite), each score table merged over the workers and
    reduced to its Mann-Whitney sums."""
    losses = [p["loss_sum"] for p in parts]
    loss = None if None in losses else float(sum(losses))
    weight = float(sum(p["loss_weight"] for p in parts))
    if loss is None or not (math.isfinite(loss) and math.isfinite(weight)):
        loss, weight = None, weight if math.isfinite(weight) else 0.0
    corrects = [p["correct"] for p in parts]
    classify = None not in corrects
    result = {"loss_sum": loss, "loss_weight": weight,
              "correct": int(sum(corrects)) if classify else None,
              "scored": int(sum(p["scored"] for p in parts)) if classify else None,
              "count": int(sum(p["count"] for p in parts)),
              "eval_s": max(p["eval_s"] for p in parts)}
    names = {name for p in parts for name in (p.get("metrics") or {})}
    tabled = {name for p in parts for name in (p.get("tables") or {})}
    if not names and not tabled:
        return result
    metrics: dict[str, list[float | None] | None] = {}
    for name in sorted(names - tabled):
        lists = [(p.get("metrics") or {}).get(name, []) for p in parts]
        if None in lists:
            metrics[name] = None  # not finite on some worker
            continue
        lists = [v for v in lists if v]  # [] from a worker without evaluation rows
        if len({len(v) for v in lists}) > 1:
            metrics[name] = None  # workers disagree on the count: nothing to add up
            continue
        totals = [_finite_sum(list(column)) for column in zip(*lists, strict=True)]
        metrics[name] = None if None in totals else totals
    for name in sorted(tabled):
        if any((p.get("metrics") or {}).get(name, []) is None for p in parts):
            metrics[name] = None  # a worker's scores were not finite
            continue
        merged = merge_tables([(p.get("tables") or {}).get(name, np.zeros((0, 3)))
                               for p in parts])
        metrics[name] = mann_whitney(merged)
    result["metrics"] = metrics
    return result
