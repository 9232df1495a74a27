"""Fine-tuning's averaging rounds: round time and bytes through the driver a round for a
frozen backbone of 25.2M parameters under a trainable adapter of 266k (1.05% of all), sync mode,
2 workers on local[2], averaging **only what trains** (this code) against **averaging
everything** (the code before issue 30, commit 923ce8f, from its own checkout and venv).

The model: 6 frozen `Linear(2048, 2048)` layers (GELU between them), each with a rank-10
low-rank adapter beside it (LoRA: `x @ A.T @ B.T`, B zero at the start), and a trainable
`Linear(2048, 10)` head. The backbone's weights are drawn under the fit's seed, so every
replica builds the same ones (as `from_pretrained` on a shared path would). The data:
`--rounds` rounds of 2 workers x `--batch-size` x `--averaging-frequency` rows of 2048
Gaussian features labelled by a fixed random teacher, in order (no shuffle). Adam, lr 1e-3,
no evaluation. Both sides take the same steps from the same start, so their rounds' train
losses must agree (`max_train_loss_difference`): only what travels differs.

Each side runs in fresh processes of its own Python (`--old-python` for the old side, run
from the old checkout so that its executors import the old package: every worker's
`library` is checked against the side's), one fresh local[2] session per side and
`--sessions`, the sides' order alternating from session to session; a session runs
`--repeats` fits of each transport, the transports alternating, their order rotating from
session to session. Per fit, from `FitResult.history`: each round's `time_round_s` (the
driver's wall time from one round's end to the next: the workers' steps, the transfer and
the average) and `driver_mb` (bytes the driver's sockets moved that round, both ways,
all workers; the last round's is given apart: it ends with a checkpoint, which brings each
worker's optimizer state, and with the collective worker 0's average, to the driver). A
session's first fit is **cold**, the others warm; a fit's first round (the workers' first
steps and exchange) is given apart from its later rounds (`warm_*`). Medians; the ratios
are of medians measured in this one run. `--transports driver collective` adds the
collective transport (the tasks all-reduce among themselves; `driver_mb` is then the control
plane only, so each side also reports what its rule averages: `averaged_mb`, the bytes of one
replica's averaged tensors).

    git worktree add /work/wt/old 923ce8f
    (cd /work/wt/old && python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 -e .)
    python bench/finetune_rounds.py --old-python /work/wt/old/.venv/bin/python
        [--old-repo /work/wt/old] [--sessions 2] [--repeats 3] [--rounds 6]
        [--transports driver [collective]]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402

WIDTH, LAYERS, RANK, CLASSES, SEED = 2048, 6, 10, 10, 0
SIDES = ("only_what_trains", "averaging_everything")


def model_fn():
    """The frozen backbone with its adapters and head (the parts that train)."""
    import torch
    from torch import nn

    class Adapted(nn.Module):
        """A frozen Linear and its low-rank adapter beside it."""

        def __init__(self, base: nn.Linear) -> None:
            super().__init__()
            self.base = base.requires_grad_(False)
            self.down = nn.Parameter(torch.randn(RANK, base.in_features) / base.in_features**.5)
            self.up = nn.Parameter(torch.zeros(base.out_features, RANK))  # starts as base

        def forward(self, x):
            return self.base(x) + (x @ self.down.T) @ self.up.T

    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [Adapted(nn.Linear(WIDTH, WIDTH)), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, CLASSES))


def sizes() -> dict:
    model = model_fn()
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"parameters": total, "trainable": trainable, "frozen": total - trainable,
            "trainable_fraction": trainable / total}


def make_data(spark, rows: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((rows, WIDTH), dtype=np.float32)
    label = (x @ rng.standard_normal((WIDTH, CLASSES), dtype=np.float32)).argmax(1)
    return spark.createDataFrame(pd.DataFrame({"features": list(x), "label": label})).cache()


def fit_run(df, transport: str, batch: int, frequency: int) -> dict:
    import sparkdl_avg
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.averaging.flat_buffer import averaged_tensors

    config = TrainConfig(num_workers=2, epochs=1, batch_size=batch, optimizer="adam", lr=1e-3,
                         averaging_frequency=frequency, transport=transport, seed=SEED,
                         shuffle=False, log_model=False, experiment_name="bench-finetune")
    t0 = time.perf_counter()
    result = fit(df, model_fn, config)
    wall = time.perf_counter() - t0
    library = os.path.dirname(sparkdl_avg.__file__)
    executors = sorted({w["library"] for w in result.workers})
    if executors != [library]:  # the side's executors must run the side's code
        raise RuntimeError(f"executors imported {executors}, the driver {library}")
    averaged = sum(t.numel() * 4 for t in averaged_tensors(model_fn()))  # float32 wire
    rows = result.history
    return {"round_s": [r["time_round_s"] for r in rows],
            "driver_mb": [r["driver_mb"] for r in rows],
            "communication_s": [r["time_communication_s"] for r in rows],
            "averaging_s": [r["time_averaging_s"] for r in rows],
            "compute_s": [r["time_compute_s"] for r in rows],
            "train_loss": [r["train_loss"] for r in rows],
            "averaged_mb": averaged / 1e6, "fit_wall_s": wall, "timings": result.timings,
            "executor_library": executors[0]}


def one_side(transports: list[str], repeats: int, rounds: int, batch: int,
             frequency: int) -> dict:
    """This Python's side: a fresh local[2] session, `repeats` fits per transport (the
    transports alternate, the first one's first fit is the session's cold fit), and which
    code ran (the package's folder and its commit)."""
    import sparkdl_avg
    from sparkdl_avg import SPARK_CONF

    spark = local_session(2, **SPARK_CONF)
    try:
        df = make_data(spark, 2 * batch * frequency * rounds)
        df.count()
        fits: dict[str, list] = {t: [] for t in transports}
        for _ in range(repeats):
            for t in transports:
                fits[t].append(fit_run(df, t, batch, frequency))
    finally:
        spark.stop()
    library = os.path.dirname(sparkdl_avg.__file__)
    commit = subprocess.run(["git", "-C", library, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    return {"library": library, "commit": commit, "python": sys.executable,
            "order": transports, "fits": fits}


def summarize(sessions: list[dict], transport: str) -> dict:
    """Medians of one side's fits with `transport`. Cold: the sessions' first fits (those
    where this transport went first); warm: the rest. Per fit, its first round (the initial
    state reaches the workers, their first steps) and its later rounds (`warm_*`); bytes
    through the driver a round (the last round apart: it ends with a checkpoint)."""
    cold = [s["fits"][transport][0] for s in sessions if s["order"][0] == transport]
    warm = [f for s in sessions for f in s["fits"][transport][s["order"][0] == transport:]]
    fits = cold + warm

    def later(key):
        return [x for f in fits for x in f[key][1:]]

    def maybe(values):
        return median(values) if values else None

    exchange = [c + a for f in fits
                for c, a in zip(f["communication_s"][1:], f["averaging_s"][1:], strict=True)]
    return {"cold_first_round_s": maybe([f["round_s"][0] for f in cold]),
            "first_round_s": maybe([f["round_s"][0] for f in warm]),
            "warm_round_s": median(later("round_s")),
            "warm_compute_s": median(later("compute_s")),
            "warm_exchange_s": median(exchange),  # transfer + averaging: what bytes cost
            "driver_mb_per_round": median([x for f in fits for x in f["driver_mb"][:-1]]),
            "last_round_driver_mb": median([f["driver_mb"][-1] for f in fits]),
            "averaged_mb": fits[0]["averaged_mb"],
            "cold_fit_wall_s": maybe([f["fit_wall_s"] for f in cold]),
            "fit_wall_s": maybe([f["fit_wall_s"] for f in warm]),
            "cold_fits": len(cold), "warm_fits": len(warm), "warm_rounds": len(exchange)}


def compare(runs: dict, transport: str) -> dict:
    """Both sides' summaries, their ratios (everything over only what trains), and the check
    that both took the same steps: what differs is only what travels."""
    new, old = (summarize(runs[name], transport) for name in SIDES)
    losses = [(a, b) for n, o in zip(*(runs[name] for name in SIDES), strict=True)
              for fn, fo in zip(n["fits"][transport], o["fits"][transport], strict=True)
              for a, b in zip(fn["train_loss"], fo["train_loss"], strict=True)]
    return {SIDES[0]: new, SIDES[1]: old,
            "max_train_loss_difference": max(abs(a - b) for a, b in losses),
            "ratio_everything_to_trainable": {
                k: old[k] / new[k] for k in new
                if k.endswith(("_s", "_mb", "_round")) and old[k] and new[k]}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--old-python", required=True, help="the old checkout's venv python")
    parser.add_argument("--old-repo", help="the old checkout (default: 3 folders above "
                        "--old-python)")
    parser.add_argument("--sessions", type=int, default=2, help="fresh processes per side")
    parser.add_argument("--repeats", type=int, default=3, help="fits per session")
    parser.add_argument("--rounds", type=int, default=6, help="averaging rounds per fit")
    parser.add_argument("--batch-size", type=int, default=16, help="per worker")
    parser.add_argument("--averaging-frequency", type=int, default=4)
    parser.add_argument("--transports", nargs="+", default=["driver"],
                        choices=["driver", "collective"])
    parser.add_argument("--side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = [str(x) for x in (args.repeats, args.rounds, args.batch_size,
                              args.averaging_frequency)]
    if args.side:
        print(json.dumps(one_side(args.transports, *map(int, shape))))
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old_repo = args.old_repo or os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(args.old_python))))
    sides = dict(zip(SIDES, ((sys.executable, here), (args.old_python, old_repo)), strict=True))
    folder = tempfile.mkdtemp(prefix="bench-finetune-")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder}/mlflow.db"}
    side_args = ["--side", "--old-python", args.old_python, "--repeats", shape[0],
                 "--rounds", shape[1], "--batch-size", shape[2],
                 "--averaging-frequency", shape[3], "--transports"]
    runs: dict[str, list] = {name: [] for name in sides}
    for i in range(args.sessions):  # the sides' order alternates from session to session,
        k = i % len(args.transports)  # and the transports' (the first is the cold fit's)
        order = args.transports[k:] + args.transports[:k]
        for name in SIDES if i % 2 == 0 else SIDES[::-1]:
            logging.info("session %d: %s, %s", i + 1, name, " then ".join(order))
            python, cwd = sides[name]  # Spark's Python workers start in the driver's folder
            runs[name].append(in_fresh_process(  # and import from it: the side's checkout
                __file__, *side_args, *order, env=env, python=python, cwd=cwd))
    summary = {t: compare(runs, t) for t in args.transports}
    report("finetune_rounds", {
        "model": {"width": WIDTH, "layers": LAYERS, "rank": RANK, "classes": CLASSES,
                  **sizes()},
        "workers": 2, "sessions": args.sessions, "repeats": args.repeats,
        "rounds": args.rounds, "batch_size": args.batch_size,
        "averaging_frequency": args.averaging_frequency,
        "sides": {name: {"library": runs[name][0]["library"],
                         "commit": runs[name][0]["commit"],
                         "python": runs[name][0]["python"]} for name in sides},
        "summary": summary, "runs": runs,
    })


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
