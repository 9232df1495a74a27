"""Loss (and, for classifiers, correct predictions) of a model over a task's evaluation rows,
a chunk of `TrainConfig.eval_rows` at a time (from either data cache). Both modes evaluate in
the tasks."""

from __future__ import annotations


def evaluate_batches(model, batches, loss_fn, classify: bool) -> dict:
    """{"loss_sum", "correct" (None unless classify), "count"} over an iterable of (x, y)
    batches; the model's training mode is left as it was."""
    import torch

    loss_sum = correct = None  # summed on the device: one host sync at the end, not two a chunk
    count = 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for xb, yb in batches:
            out = model(xb)
            chunk_loss = loss_fn(out, yb).double() * xb.shape[0]
            loss_sum = chunk_loss if loss_sum is None else loss_sum + chunk_loss
            count += int(xb.shape[0])
            if classify:
                hits = (out.argmax(dim=1) == yb).sum()
                correct = hits if correct is None else correct + hits
    model.train(was_training)
    return {"loss_sum": float(loss_sum) if loss_sum is not None else 0.0,
            "correct": (int(correct) if correct is not None else 0) if classify else None,
            "count": count}
