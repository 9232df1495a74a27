"""Loss (and, for classifiers, correct predictions) of a model over tensors, in chunks.
Used by the tasks in sync mode and by the driver in async mode."""

from __future__ import annotations

EVAL_CHUNK = 8192


def evaluate(model, x, y, loss_fn, classify: bool) -> dict:
    """{"loss_sum", "correct" (None unless classify), "count"}; the model's training mode is
    left as it was."""
    import torch

    loss_sum, correct = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, x.shape[0], EVAL_CHUNK):
            xb, yb = x[start:start + EVAL_CHUNK], y[start:start + EVAL_CHUNK]
            out = model(xb)
            loss_sum += float(loss_fn(out, yb)) * xb.shape[0]
            if classify:
                correct += int((out.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return {"loss_sum": loss_sum, "correct": correct if classify else None,
            "count": int(x.shape[0])}
