"""What a training step costs inside a Spark task, against the same step in a bare process:
MNIST-1D's MLP 40-1024-1024-10, batch 50, Adam, one thread, float32.

- bare, alone: one process, one thread, steps on random rows of a 10k x 40 tensor;
- bare, two side by side: two such processes at once (the load two tasks put on two cores);
- in a task: a warm 2-worker fit on local[2] (5 epochs of 8k rows a worker, averaging every
  8 steps, evaluation after the last round only), its tasks' own compute time per step
  (`time_compute_s` / steps of each round);
- the same fits with overlap_averaging, alternating with those in the same session;
- speedup: the work of the whole fit (both workers' steps) in one bare thread, over the fit's
  training time (rounds, averaging and evaluation included).

    python bench/step_cost.py [--steps 800]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402


def bare_steps(steps: int) -> float:
    """Milliseconds a step, after 50 warm-up steps."""
    import torch

    from sparkdl_avg.examples import mnist1d

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = mnist1d.mlp((1024, 1024))()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)  # as the fit's tasks
    x, y = torch.randn(10_000, 40), torch.randint(0, 10, (10_000,))

    def step() -> None:
        idx = torch.randint(0, len(x), (50,))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()

    for _ in range(50):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - t0) / steps * 1000


def bare(processes: int, steps: int) -> list[float]:
    cmd = [sys.executable, __file__, "--bare", "--steps", str(steps)]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
               for _ in range(processes)]
    return [float(p.communicate()[0].strip().splitlines()[-1]) for p in running]


def in_tasks(fits: int) -> dict[bool, list[dict]]:
    """`fits` warm fits each without and with overlap_averaging, alternating in one session
    (after one of each that warms it)."""
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        out: dict[bool, list[dict]] = {False: [], True: []}
        for _ in range(fits + 1):  # the first of each warms the session
            for overlap in (False, True):
                cfg = TrainConfig(num_workers=2, epochs=5, batch_size=50, optimizer="adam",
                                  lr=1e-3, eval_every=10**6, log_model=False,
                                  experiment_name="bench-step", overlap_averaging=overlap,
                                  # after the last round only, as the timed default here
                                  checkpoint_every=10**6 if overlap else None)
                result = fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df)
                # 8,000 rows a worker: 160 steps an epoch, 800 in all, 100 rounds of 8 steps
                per_worker_steps = 8 * len(result.history)
                compute = sum(h["time_compute_s"] for h in result.history)
                out[overlap].append({
                    "step_ms": compute / per_worker_steps * 1000,
                    "train_s": result.timings["train_s"],
                    "rounds_s": sum(h["time_round_s"] for h in result.history),
                    "compute_s": compute,
                    "communication_s": sum(h["time_communication_s"]
                                           for h in result.history),
                    "averaging_s": sum(h["time_averaging_s"] for h in result.history),
                    "steps_per_worker": per_worker_steps,
                    "accuracy": result.history[-1]["eval_accuracy"]})
        return {k: v[1:] for k, v in out.items()}
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--fits", type=int, default=3)
    parser.add_argument("--bare", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.bare:
        print(bare_steps(args.steps))
        return
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    alone = [bare(1, args.steps)[0] for _ in range(3)]
    pairs = [bare(2, args.steps) for _ in range(3)]
    side_by_side = [ms for pair in pairs for ms in pair]
    by_mode = in_tasks(args.fits)
    fits, overlapped = by_mode[False], by_mode[True]
    task_ms = median([f["step_ms"] for f in fits])
    train_s = median([f["train_s"] for f in fits])
    overlapped_s = median([f["train_s"] for f in overlapped])
    one_thread_s = median(alone) / 1000 * 2 * fits[0]["steps_per_worker"]
    report("step_cost", {
        "bare_alone_ms": median(alone), "bare_side_by_side_ms": median(side_by_side),
        "task_ms": task_ms, "task_over_side_by_side": task_ms / median(side_by_side),
        "fit_train_s": train_s, "one_bare_thread_s": one_thread_s,
        "speedup_over_one_bare_thread": one_thread_s / train_s,
        "overlapped_train_s": overlapped_s,
        "overlapped_speedup_over_one_bare_thread": one_thread_s / overlapped_s,
        "bare_side_by_side_speedup": median(alone) * 2 / median(side_by_side),
        "fits": fits, "overlapped_fits": overlapped, "alone": alone,
        "side_by_side": side_by_side,
    })


if __name__ == "__main__":
    main()
