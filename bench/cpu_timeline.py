"""Where the CPU goes while a fit runs, every half second: the JVM's threads (the JIT
compilers, Spark's task threads, the collector, the rest), this driver's Python and the
executors' Python (the daemon and its workers). A fresh local[2] session with
`sparkdl_avg.SPARK_CONF`, MNIST-1D read and counted, then one fit of the
TorchDistributor comparison's workload (2 workers, 5 epochs, batch 50, Adam, evaluation after
the last round); `--warm` samples the session's second fit instead of its first. Each line is
the CPU seconds each part used in that half second: 1.0 is both cores busy. Needs psutil.

    python bench/cpu_timeline.py [--warm]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402

PARTS = ("jvm_jit", "jvm_tasks", "jvm_gc", "jvm_other", "driver_python", "executor_python")


def _jvm_part(thread_name: str) -> str:
    if "Compiler" in thread_name:
        return "jvm_jit"
    if "GC" in thread_name or "G1" in thread_name:
        return "jvm_gc"
    return "jvm_tasks" if "task" in thread_name.lower() else "jvm_other"


def cpu_by_part(jvm_pid: int) -> collections.Counter:
    import psutil

    tick, used = os.sysconf("SC_CLK_TCK"), collections.Counter()
    for tid in os.listdir(f"/proc/{jvm_pid}/task"):
        try:
            with open(f"/proc/{jvm_pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread ended
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        used[_jvm_part(stat[stat.index("(") + 1:stat.rindex(")")])] += \
            (int(fields[11]) + int(fields[12])) / tick
    own = psutil.Process().cpu_times()
    used["driver_python"] = own.user + own.system
    for child in psutil.Process(jvm_pid).children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        used["executor_python"] += times.user + times.system
    return used


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", action="store_true", help="sample the second fit")
    args = parser.parse_args()
    from sparkdl_avg import SPARK_CONF, TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2, **SPARK_CONF)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()
        cfg = TrainConfig(num_workers=2, epochs=5, batch_size=50, optimizer="adam", lr=1e-3,
                          eval_every=10**6, experiment_name="bench-cpu-timeline")
        if args.warm:
            fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df)
        jvm_pid = spark.sparkContext._gateway.proc.pid
        samples, stop = [], threading.Event()

        def sample() -> None:
            t0, last = time.perf_counter(), cpu_by_part(jvm_pid)
            while not stop.wait(0.5):
                now = cpu_by_part(jvm_pid)
                samples.append({"t": round(time.perf_counter() - t0, 2),
                                **{p: round(now[p] - last[p], 2) for p in PARTS}})
                last = now

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        result = fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df)
        stop.set()
        sampler.join()
    finally:
        spark.stop()
    print("    t  " + " ".join(f"{p:>15}" for p in PARTS), file=sys.stderr)
    for s in samples:
        print(f"{s['t']:5.1f}  " + " ".join(f"{s[p]:15.2f}" for p in PARTS), file=sys.stderr)
    report("cpu_timeline_warm" if args.warm else "cpu_timeline",
           {"timings": result.timings, "samples": samples})


if __name__ == "__main__":
    main()
