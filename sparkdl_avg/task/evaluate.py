"""Loss (and, for classifiers, correct predictions) of a model over a task's evaluation rows,
a chunk of `TrainConfig.eval_rows` at a time (from either data cache). Both modes evaluate in
the tasks."""

from __future__ import annotations


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
