"""MNIST-1D, 20,000 samples, MLP 40-1024-1024-10, 2 workers, 5 epochs, global batch 100, Adam:
total wall time and test accuracy of `sparkdl_avg.fit` (averaging every
`--averaging-frequency` steps, 8 by default, MLflow logging and model included) vs pyspark's
TorchDistributor running DDP (gloo, 2 processes; it all-reduces gradients every step) on the
same data. Each side runs `--repeats` times in a row and its median is reported, along with every
run: sparkdl-avg's first fit in a session also starts Spark's Python workers (torch imported),
later fits reuse them; TorchDistributor starts new torchrun processes on every run.

    python bench/mnist1d_vs_torchdistributor.py [--repeats 3] [--averaging-frequency 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402

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


def run_sparkdl_avg(spark, train_df, test_df, every: int) -> tuple[float, float, dict]:
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    cfg = TrainConfig(num_workers=2, epochs=EPOCHS, batch_size=BATCH, averaging_frequency=every,
                      optimizer="adam", lr=LR, seed=SEED, experiment_name="bench-mnist1d",
                      eval_every=10**6)  # evaluate once, after the last round, as DDP does
    t0 = time.perf_counter()
    result = fit(train_df, mnist1d.mlp(HIDDEN), cfg, eval_df=test_df)
    return time.perf_counter() - t0, result.history[-1]["eval_accuracy"], result.timings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--averaging-frequency", type=int, default=8,
                        help="1: average after every step, as DDP all-reduces every step")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    try:
        folder = mnist1d.write_parquet(20_000, 42, None)
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()
        ours, theirs, timings = [], [], []
        for _ in range(args.repeats):
            wall, acc, t = run_sparkdl_avg(spark, train_df, test_df,
                                           args.averaging_frequency)
            ours.append((wall, acc))
            timings.append(t)
        for _ in range(args.repeats):
            theirs.append(run_torchdistributor(folder))
    finally:
        spark.stop()
    ours_wall, td_wall = median([w for w, _ in ours]), median([w for w, _ in theirs])
    name = "mnist1d_vs_torchdistributor" + (
        f"_every_{args.averaging_frequency}" if args.averaging_frequency != 8 else "")
    report(name, {
        "averaging_frequency": args.averaging_frequency,
        "sparkdl_avg_wall_median_s": ours_wall,
        "torchdistributor_wall_median_s": td_wall,
        "wall_ratio": ours_wall / td_wall,
        "sparkdl_avg_accuracy_median": median([a for _, a in ours]),
        "torchdistributor_accuracy_median": median([a for _, a in theirs]),
        "sparkdl_avg_runs": ours, "torchdistributor_runs": theirs,
        "sparkdl_avg_timings": timings,
    })


if __name__ == "__main__":
    main()
