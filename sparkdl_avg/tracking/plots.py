"""The pictures logged with every run: learning curves, and (sync) a timeline of each worker's
phases per round, after Deeplearning4j's training-stats page. Matplotlib's object API only
(no pyplot), so a notebook's own backend and figures are left alone."""

from __future__ import annotations

from collections.abc import Sequence

PHASES = (("setup", "#BBBBBB"), ("compute", "#4C72B0"), ("transfer", "#DD8452"),
          ("waiting", "#C44E52"), ("averaging", "#8172B3"), ("return+eval", "#55A868"))
"""A worker's round as the driver's clock sees it: setup (the first round's optimizer,
warm-up), its local steps, transfer (the previous average still arriving and this push going
out: without synchronised clocks the two cannot be told apart), waiting for the slowest push,
the driver averaging, and the average being sent (and evaluation when due)."""


def learning_curves(history: Sequence[dict], x_key: str):
    """Loss (train, eval) and eval accuracy against `x_key` ("round" or "interval")."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import ScalarFormatter

    fig = Figure(figsize=(9, 3.6), layout="constrained")
    loss_ax, acc_ax = fig.subplots(1, 2)
    for key, style in (("train_loss", "-"), ("eval_loss", "o-")):
        points = [(h[x_key], h[key]) for h in history if key in h]
        if points:
            loss_ax.plot(*zip(*points, strict=True), style, markersize=3,
                         label=key.replace("_", " "))
    loss_ax.set(xlabel=x_key, ylabel="loss (log scale)", title="Loss")
    loss_ax.set_yscale("log")
    loss_ax.yaxis.set_major_formatter(ScalarFormatter())
    loss_ax.yaxis.set_minor_formatter(ScalarFormatter())
    loss_ax.legend()
    shown = False  # round 0 (no train_loss) starts the eval curves where training starts
    for key, color in (("eval_accuracy", "#55A868"), ("eval_auc", "#C44E52")):
        points = [(h[x_key], h[key]) for h in history if key in h]
        if points:
            acc_ax.plot(*zip(*points, strict=True), "o-", markersize=3, color=color,
                        label=key.removeprefix("eval_"))
            shown = True
    if shown:
        acc_ax.set(ylim=(0, 1))
        acc_ax.legend()
    else:
        acc_ax.text(0.5, 0.5, "no eval_df or not a classifier", ha="center", va="center",
                    transform=acc_ax.transAxes)
    acc_ax.set(xlabel=x_key, ylabel="accuracy, auc", title="Eval accuracy")
    for ax in (loss_ax, acc_ax):
        ax.grid(alpha=0.3)
    return fig


def worker_timeline(timeline: Sequence[dict], num_workers: int):
    """One row per worker; each round's phases as coloured spans on the time axis.

    `timeline`: per round {"round", "workers": [{phase: (start, end)}, ...]} with times
    in seconds since training began (a worker an elastic fit did not average: {})."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    fig = Figure(figsize=(11, 1.2 + 0.7 * num_workers), layout="constrained")
    ax = fig.subplots()
    for name, color in PHASES:
        for w in range(num_workers):
            spans = [(start, end - start) for entry in timeline
                     for start, end in [entry["workers"][w].get(name, (0, 0))] if end > start]
            if spans:
                ax.broken_barh(spans, (w - 0.35, 0.7), facecolors=color, linewidth=0)
    ax.set_yticks(range(num_workers), [f"worker {w}" for w in range(num_workers)])
    ax.invert_yaxis()
    ax.set(xlabel="seconds since training began",
           title=f"What each worker did, {len(timeline)} rounds")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in PHASES], ncols=len(PHASES),
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if num_workers < 3 else -0.15),
              frameon=False)
    return fig
