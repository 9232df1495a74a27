"""MNIST-1D, 20,000 samples, MLP 40-1024-1024-10, 2 workers, 5 epochs, global batch 100, Adam
1e-3: `sparkdl_avg.fit` (averaging every `--averaging-frequency` steps; 8 and 1 by default,
each a side of its own) against pyspark's TorchDistributor running DDP (gloo, 2 processes;
it all-reduces gradients every step) on the same data.

Two figures a run, on every side: the wall time of the whole call (`fit(...)` or
`TorchDistributor.run(...)`), and the time from that call to the end of the first
evaluation whose test accuracy reaches `--target` (77% by default). Both sides evaluate the
whole test set (4,000 rows) after every epoch, inside the timed call: we as `fit` does with
`eval_every=None` (each worker scores its share of the test set, the driver combines them),
DDP's rank 0 alone on the full set while rank 1 waits at the next all-reduce. Our times
come from `fit(on_round=...)` on the driver (with `--transport collective` that callback
makes rank 0 send the average to the driver every round, a cost the default transport does
not have), DDP's from rank 0's clock; both against the clock read just before the call.

What differs between the sides, besides the synchronisation: we validate the data and
partition it through Spark (the training data arrive over Spark, not from the Parquet files),
log to MLflow (metrics, two pictures, the model) and checkpoint after the last round;
DDP's processes read the Parquet files themselves (rank r takes rows r, r+2, ...) and log
nothing. Both use the fused Adam kernel, one thread per worker, and seed 0, but the initial
parameters and the epoch orders are not the same draws.

Each side runs in fresh processes with a fresh local[2] session (`--sessions` rounds; in
each round every side gets one fresh process, in an order that rotates from round to round),
`--repeats` runs a session: a session's first run is cold (sparkdl-avg's first fit also
starts Spark's Python workers and imports torch and MLflow there), later runs are warm
(TorchDistributor starts new torchrun processes on every run). Medians of the cold runs and
of the warm runs are reported, and their ratios to TorchDistributor's. Both sides find the
session up and the data loaded, and the MLflow store existing, as on any machine that has
run a job before; both sessions have `sparkdl_avg.SPARK_CONF`, as our jobs' do
(TorchDistributor's torchrun processes import torch themselves either way).

    python bench/mnist1d_vs_torchdistributor.py [--sessions 2] [--repeats 3] [--target 0.77]
        [--averaging-frequency 8 1] [--transport collective] [--overlap] [--c1-jit]
        [--outer-optimizer nesterov] [--delta-compression int4]

`--c1-jit` gives both sessions' JVM `-XX:TieredStopAtLevel=1` (spark.driver.extraJavaOptions):
in local mode that JVM is the executor too, and its C2 compiler's CPU (1.4-2.5 s a fit here)
comes out of the training processes' two cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import C1_JIT, in_fresh_process, local_session, median, report  # noqa: E402

EPOCHS, BATCH, LR, HIDDEN, SEED = 5, 50, 1e-3, (1024, 1024), 0


def ddp_train(train_path: str, test_path: str) -> list:
    """Runs in each torchrun process TorchDistributor starts; returns (rank 0) each epoch's
    (epoch, time.time() after its evaluation, test accuracy)."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from sparkdl_avg.examples import mnist1d

    torch.set_num_threads(1)  # one core per process, as each sparkdl-avg task has
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def read(path):
        t = pq.read_table(path)
        x = t.column("features").combine_chunks().flatten().to_numpy().reshape(len(t), -1)
        return torch.from_numpy(x.copy()), torch.from_numpy(t.column("label").to_numpy().copy())

    x, y = read(train_path)
    x, y = x[rank::world], y[rank::world]
    xt, yt = read(test_path) if rank == 0 else (None, None)
    torch.manual_seed(SEED)
    model = DistributedDataParallel(mnist1d.mlp(HIDDEN)())
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)  # as sparkdl-avg uses
    steps = len(x) // BATCH
    curve = []
    for epoch in range(EPOCHS):
        order = torch.from_numpy(np.random.default_rng([SEED, rank, epoch]).permutation(len(x)))
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
        if rank == 0:  # rank 1 waits for it at the next all-reduce
            with torch.no_grad():
                accuracy = float((model.module(xt).argmax(1) == yt).float().mean())
            curve.append((epoch, time.time(), accuracy))
    dist.destroy_process_group()
    return curve


def run_torchdistributor(folder) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    t0, p0 = time.time(), time.perf_counter()
    curve = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        ddp_train, str(folder / "train.parquet"), str(folder / "test.parquet"))
    return {"wall_s": time.perf_counter() - p0,
            "curve": [(epoch, t - t0, acc) for epoch, t, acc in curve]}


def run_sparkdl_avg(spark, train_df, test_df, every: int, transport: str,
                    overlap: bool, outer: str = "average", compression: str = "none") -> dict:
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    cfg = TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=BATCH, averaging_frequency=every,
                      optimizer="adam", lr=LR, seed=SEED, experiment_name="bench-mnist1d",
                      eval_every=None,  # after the round in which each epoch ends, as DDP
                      transport=transport, overlap_averaging=overlap,
                      outer_optimizer=outer, delta_compression=compression,
                      eval_before_training=False,  # DDP's curve starts after its epoch 1
                      # overlap needs checkpoints counted in rounds: after the last only,
                      # as the timed default gives a fit this short
                      checkpoint_every=10**6 if overlap else None)
    evaluations: list[tuple[int, float, float]] = []

    def on_round(row: dict) -> bool:  # the driver's clock when a round's evaluation is in
        if "eval_accuracy" in row:
            evaluations.append((row["round"], time.time(), row["eval_accuracy"]))
        return False

    t0, p0 = time.time(), time.perf_counter()
    result = fit(train_df, mnist1d.mlp(HIDDEN), cfg, eval_df=test_df, on_round=on_round)
    return {"wall_s": time.perf_counter() - p0,
            "curve": [(epoch, t - t0, acc) for epoch, (_, t, acc) in enumerate(evaluations)],
            "timings": result.timings}


def one_side(side: str, repeats: int, every: int, transport: str, overlap: bool,
             c1_jit: bool, outer: str = "average", compression: str = "none") -> list:
    """This process: a fresh local[2] session and `repeats` runs of one side."""
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import mnist1d

    # both sides: the settings our jobs use
    spark = local_session(2, **SPARK_CONF, **(C1_JIT if c1_jit else {}))
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()  # the session is up and has run a job, on both sides
        if side == "ours":
            return [run_sparkdl_avg(spark, train_df, test_df, every, transport, overlap,
                                    outer, compression) for _ in range(repeats)]
        folder = mnist1d.write_parquet(20_000, 42, None)
        return [run_torchdistributor(folder) for _ in range(repeats)]
    finally:
        spark.stop()


def to_target(run: dict, target: float) -> float | None:
    """Seconds from the call to the end of the first evaluation at or above `target`."""
    return next((t for _, t, acc in run["curve"] if acc >= target), None)


def summary(sessions: list, target: float) -> dict:
    """Medians over a side's cold runs (each session's first) and warm runs (the rest)."""
    def medians(runs: list) -> dict:
        reached = [to_target(r, target) for r in runs]
        hit = [t for t in reached if t is not None]
        return {"runs": len(runs), "wall_median_s": median([r["wall_s"] for r in runs]),
                "to_target_median_s": median(hit) if hit else None,
                "reached_target": len(hit),
                "final_accuracy_median": median([r["curve"][-1][2] for r in runs])}

    cold = [s[0] for s in sessions]
    warm = [r for s in sessions for r in s[1:]]
    return {"cold": medians(cold), "warm": medians(warm) if warm else None}


def ratios(ours: dict, theirs: dict) -> dict:
    """Ours over TorchDistributor's, for each kind of run and figure (None where one lacks it)."""
    out = {}
    for kind in ("cold", "warm"):
        for key in ("wall_median_s", "to_target_median_s"):
            a, b = (ours.get(kind) or {}).get(key), (theirs.get(kind) or {}).get(key)
            out[f"{kind}_{key.replace('_median_s', '')}"] = a / b if a and b else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="runs in each session")
    parser.add_argument("--sessions", type=int, default=2,
                        help="fresh sessions per side, the sides' order rotating")
    parser.add_argument("--averaging-frequency", type=int, nargs="+", default=[8, 1],
                        help="our sides (1: average after every step, as DDP all-reduces "
                             "every step)")
    parser.add_argument("--target", type=float, default=0.77,
                        help="test accuracy whose first reaching is timed")
    parser.add_argument("--transport", choices=["driver", "collective"], default="driver",
                        help="our side's sync transport")
    parser.add_argument("--overlap", action="store_true",
                        help="our side with overlap_averaging")
    parser.add_argument("--c1-jit", action="store_true",
                        help="both sessions' JVM compiles with C1 only")
    parser.add_argument("--outer-optimizer", default="average",
                        help="our side's outer_optimizer (nesterov: DiLoCo's)")
    parser.add_argument("--delta-compression", default="none",
                        help="our side's delta_compression (bf16, int8, int4)")
    parser.add_argument("--side", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args.side, args.repeats, args.averaging_frequency[0],
                                  args.transport, args.overlap, args.c1_jit,
                                  args.outer_optimizer, args.delta_compression)))
        return
    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    import mlflow

    mlflow.MlflowClient(store).search_experiments()  # the store exists, as on any machine
    sides = [("ours", every) for every in args.averaging_frequency] + [("theirs", 0)]
    runs: dict[str, list] = {}
    for i in range(args.sessions):
        for side, every in sides[i % len(sides):] + sides[:i % len(sides)]:
            key = f"sparkdl_avg_every_{every}" if side == "ours" else "torchdistributor"
            logging.info("session %d: %s", i + 1, key)
            runs.setdefault(key, []).append(in_fresh_process(
                __file__, "--side", side, "--repeats", str(args.repeats),
                "--averaging-frequency", str(every or 1),
                "--transport", args.transport, *(["--overlap"] if args.overlap else []),
                *(["--c1-jit"] if args.c1_jit else []),
                "--outer-optimizer", args.outer_optimizer,
                "--delta-compression", args.delta_compression,
                env={**os.environ, "MLFLOW_TRACKING_URI": store}))
    summaries = {key: summary(sessions, args.target) for key, sessions in runs.items()}
    theirs = summaries["torchdistributor"]
    name = "mnist1d_vs_torchdistributor" + (
        f"_{args.transport}" if args.transport != "driver" else "") + (
        "_overlap" if args.overlap else "") + ("_c1_jit" if args.c1_jit else "") + (
        f"_{args.outer_optimizer}" if args.outer_optimizer != "average" else "") + (
        f"_{args.delta_compression}" if args.delta_compression != "none" else "")
    report(name, {
        "averaging_frequencies": args.averaging_frequency, "target_accuracy": args.target,
        "transport": args.transport, "overlap_averaging": args.overlap, "c1_jit": args.c1_jit,
        "outer_optimizer": args.outer_optimizer, "delta_compression": args.delta_compression,
        "sessions": args.sessions, "repeats": args.repeats,
        "summary": summaries,
        "ratio_to_torchdistributor": {key: ratios(s, theirs) for key, s in summaries.items()
                                      if key != "torchdistributor"},
        "runs": runs,
    })


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
