"""MNIST-1D, 20,000 samples, MLP 40-1024-1024-10, 2 workers, 5 epochs, global batch 100, Adam:
total wall time and test accuracy of `sparkdl_avg.fit` (averaging every
`--averaging-frequency` steps, 8 by default, MLflow logging and model included) vs pyspark's
TorchDistributor running DDP (gloo, 2 processes; it all-reduces gradients every step) on the
same data. Each side runs in fresh processes with a fresh local[2] session (`--sessions` of
each, alternating), `--repeats` runs a session: a session's first run is cold (sparkdl-avg's
first fit also starts Spark's Python workers and imports torch and MLflow there), later runs
are warm (TorchDistributor starts new torchrun processes on every run). Medians of the cold
runs and of the warm runs are reported. Both sides find the session up and the data loaded,
and the MLflow store existing, as on any machine that has run a job before; both sessions have
`sparkdl_avg.SPARK_CONF`, as our jobs' do (TorchDistributor's torchrun processes import torch
themselves either way).

    python bench/mnist1d_vs_torchdistributor.py [--sessions 2] [--repeats 3]
        [--averaging-frequency 1] [--transport collective] [--overlap] [--c1-jit]

`--c1-jit` gives both sessions' JVM `-XX:TieredStopAtLevel=1` (spark.driver.extraJavaOptions):
in local mode that JVM is the executor too, and its C2 compiler's CPU (1.4-2.5 s a fit here)
comes out of the training processes' two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402

EPOCHS, BATCH, LR, HIDDEN, SEED = 5, 50, 1e-3, (1024, 1024), 0


def ddp_train(train_path: str, test_path: str) -> float:
    """Runs in each torchrun process TorchDistributor starts; returns test accuracy (rank 0)."""
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
    torch.manual_seed(SEED)
    model = DistributedDataParallel(mnist1d.mlp(HIDDEN)())
    opt = torch.optim.Adam(model.parameters(), lr=LR, fused=True)  # as sparkdl-avg uses
    steps = len(x) // BATCH
    for epoch in range(EPOCHS):
        order = torch.from_numpy(np.random.default_rng([SEED, rank, epoch]).permutation(len(x)))
        for s in range(steps):
            idx = order[s * BATCH:(s + 1) * BATCH]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
    accuracy = 0.0
    if rank == 0:
        xt, yt = read(test_path)
        with torch.no_grad():
            accuracy = float((model.module(xt).argmax(1) == yt).float().mean())
    dist.destroy_process_group()
    return accuracy


def run_torchdistributor(folder) -> tuple[float, float]:
    from pyspark.ml.torch.distributor import TorchDistributor

    t0 = time.perf_counter()
    acc = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        ddp_train, str(folder / "train.parquet"), str(folder / "test.parquet"))
    return time.perf_counter() - t0, acc


def run_sparkdl_avg(spark, train_df, test_df, every: int, transport: str,
                    overlap: bool) -> tuple[float, float, dict]:
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    cfg = TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=BATCH, averaging_frequency=every,
                      optimizer="adam", lr=LR, seed=SEED, experiment_name="bench-mnist1d",
                      eval_every=10**6,  # evaluate once, after the last round, as DDP does
                      transport=transport, overlap_averaging=overlap,
                      # overlap needs checkpoints counted in rounds: after the last only,
                      # as the timed default gives a fit this short
                      checkpoint_every=10**6 if overlap else None)
    t0 = time.perf_counter()
    result = fit(train_df, mnist1d.mlp(HIDDEN), cfg, eval_df=test_df)
    return time.perf_counter() - t0, result.history[-1]["eval_accuracy"], result.timings


def one_side(side: str, repeats: int, every: int, transport: str, overlap: bool,
             c1_jit: bool) -> list:
    """This process: a fresh local[2] session and `repeats` runs of one side."""
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import mnist1d

    jit = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"} if c1_jit else {}
    spark = local_session(2, **SPARK_CONF, **jit)  # both sides: the settings our jobs use
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()  # the session is up and has run a job, on both sides
        if side == "ours":
            return [run_sparkdl_avg(spark, train_df, test_df, every, transport, overlap)
                    for _ in range(repeats)]
        folder = mnist1d.write_parquet(20_000, 42, None)
        return [run_torchdistributor(folder) for _ in range(repeats)]
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3, help="runs in each session")
    parser.add_argument("--sessions", type=int, default=2,
                        help="fresh sessions per side, alternating sides")
    parser.add_argument("--averaging-frequency", type=int, default=8,
                        help="1: average after every step, as DDP all-reduces every step")
    parser.add_argument("--transport", choices=["driver", "collective"], default="driver",
                        help="our side's sync transport")
    parser.add_argument("--overlap", action="store_true",
                        help="our side with overlap_averaging")
    parser.add_argument("--c1-jit", action="store_true",
                        help="both sessions' JVM compiles with C1 only")
    parser.add_argument("--side", choices=["ours", "theirs"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        print(json.dumps(one_side(args.side, args.repeats, args.averaging_frequency,
                                  args.transport, args.overlap, args.c1_jit)))
        return
    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    import mlflow

    mlflow.MlflowClient(store).search_experiments()  # the store exists, as on any machine
    runs: dict[str, list] = {"ours": [], "theirs": []}
    for _ in range(args.sessions):
        for side in ("ours", "theirs"):
            runs[side].append(in_fresh_process(
                __file__, "--side", side, "--repeats", str(args.repeats),
                "--averaging-frequency", str(args.averaging_frequency),
                "--transport", args.transport, *(["--overlap"] if args.overlap else []),
                *(["--c1-jit"] if args.c1_jit else []),
                env={**os.environ, "MLFLOW_TRACKING_URI": store}))

    def summary(side: str) -> dict:
        sessions = runs[side]
        cold = [s[0][0] for s in sessions]
        warm = [r[0] for s in sessions for r in s[1:]]
        return {"cold_median_s": median(cold), "warm_median_s": median(warm) if warm else None,
                "accuracy_median": median([r[1] for s in sessions for r in s])}

    ours, theirs = summary("ours"), summary("theirs")
    name = "mnist1d_vs_torchdistributor" + (
        f"_every_{args.averaging_frequency}" if args.averaging_frequency != 8 else "") + (
        f"_{args.transport}" if args.transport != "driver" else "") + (
        "_overlap" if args.overlap else "") + ("_c1_jit" if args.c1_jit else "")
    report(name, {
        "averaging_frequency": args.averaging_frequency, "transport": args.transport,
        "overlap_averaging": args.overlap, "c1_jit": args.c1_jit,
        "sparkdl_avg": ours, "torchdistributor": theirs,
        "cold_ratio": ours["cold_median_s"] / theirs["cold_median_s"],
        "warm_ratio": ours["warm_median_s"] / theirs["warm_median_s"]
        if ours["warm_median_s"] and theirs["warm_median_s"] else None,
        "runs": runs,
    })


if __name__ == "__main__":
    main()
