"""Accuracy against bytes sent: plain averaging at k in {1, 8, 32, 128}, DiLoCo's outer
Nesterov at k in {32, 128, 512}, and int8/int4 deltas (with error feedback) at the best
Nesterov k, against DDP (pyspark's TorchDistributor, gloo, a gradient all-reduce every step)
on the same data. 4 workers on local[4].

Cases (`--case`):
- mnist1d: MNIST-1D, 16,000 training and 4,000 test rows, MLP 40-256-256-10, batch 50 per
  worker (DDP: 200 global, as the 4 workers take), Adam 3e-3, 10 epochs; test accuracy;
  3 seeds.
- char_lm: the char LM of jobs/train_char_lm.py made small (d_model 64, 2 layers, windows of
  64 bytes of the stdlib's json/email/asyncio sources, `--char-bytes` of them), batch 8 per
  worker, Adam 3e-3, 8 epochs (about 1,500 steps a worker: outer steps need many rounds);
  held-out bits per byte; 1 seed (a fit takes minutes here).

Every side evaluates after each epoch. Our bytes are `wire_mb` summed over the rounds (each
push up and each average down, as the driver transport moves them); DDP's are what a ring
all-reduce of its gradients moves each step, 2 (n - 1) S for S bytes of gradients, counted
the same way (every byte once, as sent). What differs besides the synchronisation: we
validate and partition the data through Spark and log to MLflow (the model is not logged),
DDP's ranks read Parquet files themselves; both seed 0 but draw other initial weights and
orders. Each setting runs with the case's seeds (0, 1, ...; `--seeds` for all; the
compressed ones at the k that was best for seed 0); the summary gives each setting's median
final figure.

    python bench/local_sgd.py [--case mnist1d char_lm] [--seeds N] [--char-bytes 400000]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402

WORKERS = 4
PLAIN_K, NESTEROV_K = (1, 8, 32, 128), (32, 128, 512)
CASES = {
    "mnist1d": {"epochs": 10, "batch": 50, "lr": 3e-3, "seeds": 3},
    "char_lm": {"epochs": 8, "batch": 8, "lr": 3e-3, "d_model": 64, "layers": 2, "seq": 64,
                "seeds": 1},
}
PLOTS = os.path.join(os.path.dirname(__file__), "..", "docs", "guide", "img")


def data(spark, case: str, folder: str, char_bytes: int):
    """(train_df, eval_df), also written as Parquet under `folder` for DDP's ranks."""
    if case == "mnist1d":
        from sparkdl_avg.examples import mnist1d

        train, test = mnist1d.load(spark, 20_000, seed=42)
    else:
        from sparkdl_avg.examples import char_lm

        texts = char_lm.read_files(spark, char_lm.stdlib_text_dirs(), "*.py")
        train, test = char_lm.windows(texts, CASES[case]["seq"], max_bytes=char_bytes)
    train, test = train.cache(), test.cache()
    for name, df in (("train", train), ("test", test)):
        import pyarrow.parquet as pq

        pq.write_table(df.toArrow(), os.path.join(folder, f"{name}.parquet"))
    return train, test


def model_fn(case: str, seed: int = 0):
    if case == "mnist1d":
        from sparkdl_avg.examples import mnist1d

        return mnist1d.mlp((256, 256))
    from sparkdl_avg.examples import char_lm

    c = CASES[case]
    return char_lm.transformer(c["d_model"], 4, c["layers"], c["seq"], seed)


def score(case: str, row: dict) -> float:
    """The figure a round's evaluation gives: accuracy, or bits per byte."""
    if case == "mnist1d":
        return row["eval_accuracy"]
    from sparkdl_avg.examples import char_lm

    return char_lm.bits_per_byte(row["eval_loss"])


def ours(case: str, train, test, label: str, seed: int, **fields) -> dict:
    from sparkdl_avg import TrainConfig, fit

    c = CASES[case]
    config = TrainConfig(num_workers=WORKERS, epochs=c["epochs"], batch_size=c["batch"],
                         optimizer="adam", lr=c["lr"], seed=seed, log_model=False,
                         checkpoint_every=0, eval_before_training=False,
                         experiment_name=f"bench-local-sgd-{case}", **fields)
    extra = {} if case == "mnist1d" else {"inputs": {"input_ids": "input_ids"},
                                          "label_col": "labels", "loss": "cross_entropy"}
    started = time.perf_counter()
    result = fit(train, model_fn(case, seed), config, eval_df=test, **extra)
    wall = time.perf_counter() - started
    sent, curve = 0.0, []
    for row in result.history:
        sent += row.get("wire_mb", 0.0)
        if "eval_loss" in row:
            curve.append((round(sent, 3), score(case, row)))
    logging.info("%s %s seed %d: %.4f, %.1f MB, %d rounds, %.0f s", case, label, seed,
                 curve[-1][1], sent, len(result.history), wall)
    return {"label": label, "seed": seed, "settings": {k: str(v) for k, v in fields.items()},
            "final": curve[-1][1], "mb": sent, "syncs": len(result.history),
            "wall_s": wall, "curve": curve}


def ddp_train(case: str, folder: str, seed: int) -> dict:
    """Runs in each torchrun process TorchDistributor starts; rank 0 returns its curve."""
    import numpy as np
    import pyarrow.parquet as pq
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    c = CASES[case]

    def read(name):
        t = pq.read_table(os.path.join(folder, f"{name}.parquet"))
        if case == "mnist1d":
            x = t.column("features").combine_chunks().flatten().to_numpy().reshape(len(t), -1)
            return (torch.from_numpy(x.copy()),
                    torch.from_numpy(t.column("label").to_numpy().copy()))
        ids = np.stack(t.column("input_ids").to_pylist()).astype(np.int64)
        labels = np.stack(t.column("labels").to_pylist()).astype(np.int64)
        return torch.from_numpy(ids), torch.from_numpy(labels)

    x, y = read("train")
    # every rank the same number of steps (DDP's all-reduces must pair up): the rows past
    # the last multiple of the world size (at most 3) are left out, where we repeat one
    x, y = x[:len(x) // world * world], y[:len(y) // world * world]
    x, y = x[rank::world], y[rank::world]
    xt, yt = read("test")
    torch.manual_seed(seed)
    model = DistributedDataParallel(model_fn(case, seed)())
    opt = torch.optim.Adam(model.parameters(), lr=c["lr"], fused=True)
    grad_bytes = 4 * sum(p.numel() for p in model.parameters())
    per_step = 2 * (world - 1) * grad_bytes / 1e6  # a ring all-reduce, every rank's sends
    steps, sent, curve = -(-len(x) // c["batch"]), 0.0, []

    def loss_of(out, target):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]),
                                                 target.reshape(-1), ignore_index=-100)

    for epoch in range(c["epochs"]):
        order = torch.from_numpy(np.random.default_rng([seed, rank, epoch]).permutation(len(x)))
        for s in range(steps):
            idx = order[s * c["batch"]:(s + 1) * c["batch"]]
            opt.zero_grad()
            loss_of(model(x[idx]), y[idx]).backward()
            opt.step()
            sent += per_step
        if rank == 0:
            with torch.no_grad():
                out = model.module(xt)
                figure = float((out.argmax(1) == yt).float().mean()) if case == "mnist1d" \
                    else float(loss_of(out, yt)) / np.log(2)
            curve.append((round(sent, 3), figure))
        dist.barrier()
    dist.destroy_process_group()
    return {"curve": curve, "syncs": steps * c["epochs"]}


def ddp(case: str, folder: str, seed: int) -> dict:
    from pyspark.ml.torch.distributor import TorchDistributor

    started = time.perf_counter()
    out = TorchDistributor(num_processes=WORKERS, local_mode=False, use_gpu=False).run(
        ddp_train, case, folder, seed)
    wall = time.perf_counter() - started
    logging.info("%s DDP seed %d: %.4f, %.1f MB, %.0f s", case, seed, out["curve"][-1][1],
                 out["curve"][-1][0], wall)
    return {"label": "DDP (TorchDistributor)", "seed": seed, "final": out["curve"][-1][1],
            "mb": out["curve"][-1][0], "syncs": out["syncs"], "wall_s": wall,
            "curve": out["curve"]}


def run_case(spark, case: str, char_bytes: int, seeds: int) -> dict:
    folder = tempfile.mkdtemp()
    train, test = data(spark, case, folder, char_bytes)
    better = max if case == "mnist1d" else min
    runs, k = [], None
    for seed in range(seeds):
        runs += [ours(case, train, test, f"plain k={k}", seed, averaging_frequency=k)
                 for k in PLAIN_K]
        nesterov = [ours(case, train, test, f"nesterov k={k}", seed, averaging_frequency=k,
                         outer_optimizer="nesterov") for k in NESTEROV_K]
        runs += nesterov
        if k is None:  # the compressed runs take seed 0's best k
            k = int(better(nesterov, key=lambda r: r["final"])["settings"]
                    ["averaging_frequency"])
        runs += [ours(case, train, test, f"nesterov k={k} {bits}", seed,
                      averaging_frequency=k, outer_optimizer="nesterov",
                      delta_compression=bits) for bits in ("int8", "int4")]
        runs.append(ddp(case, folder, seed))
    plot(case, [r for r in runs if r["seed"] == 0])
    finals: dict[str, list] = {}
    for run in runs:
        finals.setdefault(run["label"], []).append(run["final"])
    med = {label: statistics.median(v) for label, v in finals.items()}
    mb = {run["label"]: run["mb"] for run in runs if run["seed"] == 0}
    ddp_label, best = "DDP (TorchDistributor)", f"nesterov k={k}"
    return {"runs": runs, "median_final": med, "mb_seed0": mb, "best_nesterov_k": k,
            "nesterov_32_minus_ddp": med["nesterov k=32"] - med[ddp_label],
            "syncs_ddp_over_nesterov_32": next(r["syncs"] for r in runs
                                              if r["label"] == ddp_label)
            / next(r["syncs"] for r in runs if r["label"] == "nesterov k=32"),
            "int4_minus_float32": med[f"{best} int4"] - med[best],
            "int8_minus_float32": med[f"{best} int8"] - med[best],
            "int4_bytes_over_float32": mb[f"{best} int4"] / mb[best]}


def plot(case: str, runs: list) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for run in runs:
        mb, figure = zip(*run["curve"], strict=True)
        style = "k--" if run["label"].startswith("DDP") else \
            "-" if "nesterov" in run["label"] else ":"
        ax.plot([max(m, 1e-3) for m in mb], figure, style, marker="o", markersize=3,
                label=run["label"])
    ax.set_xscale("log")
    ax.set_xlabel("MB sent for the parameter exchange (all workers, both directions)")
    ax.set_ylabel("test accuracy" if case == "mnist1d" else "held-out bits per byte")
    ax.set_title(f"{case}: 4 workers, evaluated after each epoch (seed 0)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    os.makedirs(PLOTS, exist_ok=True)
    fig.savefig(os.path.join(PLOTS, f"local-sgd-{case}.png"), dpi=110, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--char-bytes", type=int, default=400_000)
    parser.add_argument("--seeds", type=int, help="seeds of every case (default: the case's)")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from sparkdl_avg import SPARK_CONF

    spark = local_session(WORKERS, **SPARK_CONF)
    try:
        results = {case: run_case(spark, case, args.char_bytes,
                                  args.seeds or CASES[case]["seeds"]) for case in args.case}
    finally:
        spark.stop()
    report("local_sgd", {"workers": WORKERS, "cases": CASES, **results})


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
