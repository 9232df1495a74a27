"""Train an MLP on MNIST-1D across Spark executors by parameter averaging.

    python jobs/train_mnist1d.py                       # local Spark session, local[num-workers]
    spark-submit --master spark://host:7077 jobs/train_mnist1d.py --num-workers 4
"""

from __future__ import annotations

import argparse
import sys

import _job

from sparkdl_avg.ps.rules import ALGORITHMS


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--master", help="Spark master (default: spark-submit's, else local[N])")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--mode", choices=["sync", "async"], default="sync")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=50, help="per worker")
    p.add_argument("--optimizer", choices=["sgd", "adam"], default="adam")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--momentum", type=float, default=0.0)
    # one mode's settings: passed on only when given (the other mode's are refused)
    p.add_argument("--averaging-frequency", type=int, help="sync: steps a round (8)")
    p.add_argument("--average-optimizer-state", action="store_const", const=True, help="sync")
    p.add_argument("--overlap-averaging", action="store_const", const=True,
                   help="sync: compute the next round while this one is averaged (needs "
                        "--checkpoint-every)")
    p.add_argument("--eval-every", type=int, help="sync: rounds between evaluations (5)")
    p.add_argument("--checkpoint-every", type=int, help="sync: rounds between checkpoints")
    p.add_argument("--outer-optimizer", choices=["average", "nesterov", "momentum"],
                   help="sync: what a round makes of the average (average; nesterov: DiLoCo)")
    p.add_argument("--outer-lr", type=float, help="sync: the outer step's lr (0.7)")
    p.add_argument("--outer-momentum", type=float, help="sync: its momentum (0.9)")
    p.add_argument("--averaging-warmup-steps", type=int,
                   help="sync: average every step for this many steps first")
    p.add_argument("--delta-compression", choices=["none", "bf16", "int8", "int4"],
                   help="sync: send deltas compressed, with error feedback (none)")
    p.add_argument("--transport", choices=["driver", "collective"],
                   help="sync: average on the driver (default) or all-reduce among the tasks "
                        "(trusted networks only)")
    p.add_argument("--algorithm", choices=ALGORITHMS, help="async: the server's update rule")
    p.add_argument("--push-every", type=int, help="async: steps between pushes (8)")
    p.add_argument("--staleness-bound", type=int, help="async: max pushes ahead of the slowest")
    p.add_argument("--ps-checkpoint-every", type=int, help="async: pushes between checkpoints")
    p.add_argument("--hidden", default="1024,1024", help="hidden layer widths")
    p.add_argument("--samples", type=int, default=20_000, help="MNIST-1D samples (80%% train)")
    p.add_argument("--data-dir", help="where the generated Parquet is cached")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--experiment", default="sparkdl-avg-mnist1d")
    p.add_argument("--max-failures", type=int, default=3, help="task failures to recover from")
    p.add_argument("--checkpoint-dir", help="checkpoints here instead of the MLflow run")
    p.add_argument("--resume-from", help="continue a fit whose driver died: run id or directory")
    p.add_argument("--no-log-model", action="store_true")
    p.add_argument("--data-cache", choices=["auto", "memory", "disk"], default="auto",
                   help="where each task keeps its partition (auto: memory within the budget)")
    p.add_argument("--cache-budget-mb", type=int, default=512,
                   help="largest partition a task keeps in memory under --data-cache auto")
    p.add_argument("--shuffle-buffer-mb", type=int, default=64, help="the shuffle window")
    p.add_argument("--lr-schedule", choices=["cosine", "linear"], help="default: constant lr")
    p.add_argument("--warmup-steps", type=int, default=0, help="optimizer steps of warmup")
    p.add_argument("--grad-clip-norm", type=float, help="clip the gradients' global norm")
    p.add_argument("--grad-accumulation", type=int, default=1,
                   help="micro-batches (of --batch-size) per optimizer step")
    p.add_argument("--precision", choices=["bf16", "fp16"], help="autocast (fp16: CUDA only)")
    p.add_argument("--early-stopping-patience", type=int,
                   help="stop after this many evaluations without a better eval_loss, and "
                        "return the best evaluation's model")
    return p.parse_args(argv)


def train_config(args: argparse.Namespace):
    """The fit's TrainConfig from the job's flags: one mode's settings only when given."""
    from sparkdl_avg import EarlyStopping, TrainConfig

    per_mode = {name: getattr(args, name) for name in (
        "averaging_frequency", "average_optimizer_state", "overlap_averaging", "eval_every",
        "checkpoint_every", "transport", "outer_optimizer", "outer_lr", "outer_momentum",
        "averaging_warmup_steps", "delta_compression", "algorithm", "push_every",
        "staleness_bound",
        "ps_checkpoint_every")
        if getattr(args, name) is not None}
    if args.mode == "sync":  # evaluating 4,000 rows every round would cost ~40% of training
        per_mode.setdefault("eval_every", 5)
    return TrainConfig(
        mode=args.mode, num_workers=args.num_workers, epochs=args.epochs,
        batch_size=args.batch_size, optimizer=args.optimizer, lr=args.lr,
        momentum=args.momentum, seed=args.seed, experiment_name=args.experiment,
        log_model=not args.no_log_model, max_failures=args.max_failures,
        checkpoint_dir=args.checkpoint_dir, data_cache=args.data_cache,
        cache_budget_mb=args.cache_budget_mb, shuffle_buffer_mb=args.shuffle_buffer_mb,
        lr_schedule=args.lr_schedule, warmup_steps=args.warmup_steps,
        grad_clip_norm=args.grad_clip_norm, grad_accumulation=args.grad_accumulation,
        precision=args.precision,
        early_stopping=EarlyStopping(patience=args.early_stopping_patience)
        if args.early_stopping_patience else None,
        **per_mode)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    config = train_config(args)
    from sparkdl_avg import fit
    from sparkdl_avg.examples import mnist1d

    with _job.session("sparkdl-avg-mnist1d", args.master, args.num_workers) as spark:
        train_df, test_df = mnist1d.load(spark, args.samples, cache_dir=args.data_dir)
        hidden = tuple(int(h) for h in args.hidden.split(",") if h)
        result = fit(train_df, mnist1d.mlp(hidden), config, eval_df=test_df,
                     resume_from=args.resume_from)
    final = result.history[-1]
    print(f"test accuracy {final['eval_accuracy']:.4f}  test loss {final['eval_loss']:.4f}  "
          f"fit {result.timings['total_s']:.1f}s  MLflow run {result.run_id}")
    print("timings: " + ", ".join(f"{k} {v:.2f}" for k, v in result.timings.items()))
    for w in result.workers:
        print(f"task {w['partition']}: host {w['host']} device {w['device']} gpu {w['gpu']} "
              f"sparkdl-avg {w['version']} from {w['library']} cache {w['cache']} "
              f"spilled {w['spilled_mb']:.1f} MB peak {w['peak_rss_mb'] or 0:.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
