"""Loss (and, for classifiers, correct predictions) of a model over a task's evaluation rows,
a chunk at a time (from either data cache). Both modes evaluate in the tasks."""

from __future__ import annotations

EVAL_CHUNK = 8192
"""Rows evaluated at once, at most; fewer for wide rows (`chunk_rows`)."""
EVAL_CHUNK_BYTES = 8 << 20


def chunk_rows(row_bytes: int) -> int:
    """Rows of an evaluation chunk: at most EVAL_CHUNK, and about EVAL_CHUNK_BYTES of data."""
    return max(1, min(EVAL_CHUNK, EVAL_CHUNK_BYTES // row_bytes))


def evaluate_batches(model, batches, loss_fn, classify: bool) -> dict:
    """{"loss_sum", "correct" (None unless classify), "count"} over an iterable of (x, y)
    batches; the model's training mode is left as it was."""
    import torch

    loss_sum, correct, count = 0.0, 0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for xb, yb in batches:
            out = model(xb)
            loss_sum += float(loss_fn(out, yb)) * xb.shape[0]
            count += int(xb.shape[0])
            if classify:
                correct += int((out.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return {"loss_sum": loss_sum, "correct": correct if classify else None, "count": count}
