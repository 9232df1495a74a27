"""Where a fit's time goes before its first training step, and after its last: the MNIST-1D
job's data and model (2 workers, local[2], 1 epoch, MLflow logging and model included), one
fresh process per sample so every sample's first fit is a session's first (cold); the same
process's later fits are warm. The samples share one sqlite MLflow store, created before the
first (as a machine's store outlives its jobs); `--fresh-store` gives each its own, whose
tables the first fit then creates (2-3 s here). Sessions alternate between one with
`sparkdl_avg.SPARK_CONF` (as the job's: Python workers forked from `task.warm_daemon`, torch
already imported) and a plain one, in an order that rotates from sample to sample, and each
kind is reported. `--late-warm-up` adds a kind: SPARK_CONF with the end-of-fit warm-up
(matplotlib, MLflow's model saving) started where it was before, as training starts, instead
of before the first Spark job. `--c1-jit` adds another: SPARK_CONF with the driver's JVM
compiling with C1 only (`C1_JIT`): `sparkdl_avg.local_session` gives it to the JVM it starts
(the jobs' too), and a session of the user's own may choose it; `SPARK_CONF` does not set it.
`--zipped-pyspark` adds one more: SPARK_CONF with the daemon importing pyspark from Spark's
pyspark.zip, as it did before it took the installed package's compiled modules
(`bench/_zipped_pyspark_daemon.py`). `--against REV` adds SPARK_CONF sessions that run the
library of another commit (a `git worktree` of it first on the path of the driver and of the
executors' Python; each sample says where the driver's and
the workers' library came from): the code before a change, in the same run as after it.
`--class-archive` adds sessions of `sparkdl_avg.local_session(2)`, the jobs' own: SPARK_CONF +
C1, and a JVM that maps the archive of Spark's classes (`sparkdl_avg._jvm_archive`), recorded
in a new folder by one more session before the samples and reported alone
(`class_archive_recording`: a recording JVM runs slower, and writes the archive after the
session).

Each phase is the wall time the fit spends inside it on its critical path (a phase moved to a
background thread costs only what the fit still waits for):

- session_start: the session's start, to its first job done (the same for each fit of a
  process: not part of a fit);
- run_open: the MLflow run created (a fresh sqlite store first creates its tables);
- probe: the probe job (slots, reachability, local dirs; a cold session starts its Python
  workers here);
- prepare: the data job (row counts, labels, partitioning);
- to_first_step: from the training job's start to the first step (the tasks import torch,
  load their partitions, build the replica and optimizer);
- log_model, log_figures: after the last round.

    python bench/cold_start.py [--samples 3] [--fits 3] [--late-warm-up] [--c1-jit]
        [--zipped-pyspark] [--against REV] [--class-archive]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import (  # noqa: E402
    C1_JIT,
    in_fresh_process,
    local_session,
    median,
    report,
)

from sparkdl_avg import _jvm_archive, _local_session  # noqa: E402

PHASES = ("session_start", "run_open", "probe", "prepare", "to_first_step", "train",
          "log_figures", "log_model", "total")


KINDS = {"spark_conf": {"warm_daemon": True}, "plain": {"warm_daemon": False},
         "spark_conf_late_warm_up": {"warm_daemon": True, "late_warm_up": True},
         "spark_conf_c1_jit": {"warm_daemon": True, "c1_jit": True},
         "spark_conf_zipped_pyspark": {"warm_daemon": True, "zipped_pyspark": True},
         "spark_conf_against": {"warm_daemon": True},
         "spark_conf_c1_class_archive": {"warm_daemon": True, "c1_jit": True,
                                         "class_archive": True},
         "class_archive_recording": {"warm_daemon": True, "c1_jit": True,
                                     "class_archive": True}}
"""Kinds of session: `one_session`'s settings for each."""
OPTIONAL = {"spark_conf_late_warm_up": "late_warm_up", "spark_conf_c1_jit": "c1_jit",
            "spark_conf_zipped_pyspark": "zipped_pyspark", "spark_conf_against": "against",
            "spark_conf_c1_class_archive": "class_archive"}
"""The kinds run only where their option is given."""
ZIPPED_PYSPARK = {"spark.python.daemon.module": "_zipped_pyspark_daemon",
                  "spark.executorEnv.PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
"""The daemon of `--zipped-pyspark`, a module of this folder."""


def _timed(owner, attr: str, spent: dict, name: str) -> None:
    """Wrap `owner.attr` so the wall time spent in its calls adds up under `spent[name]`."""
    inner = getattr(owner, attr)

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0

    setattr(owner, attr, timed)


def _late_warm_up(logger_class) -> None:
    """The warm-up as it was placed before: started by `ready()`, as training starts."""
    warm_up, ready = logger_class.warm_up, logger_class.ready

    def ready_then_warm_up(self):
        ready(self)  # its own warm_up() call is the no-op below
        warm_up(self)
        return self

    logger_class.warm_up = lambda self: None
    logger_class.ready = ready_then_warm_up


def one_session(fits: int, warm_daemon: bool, late_warm_up: bool = False,
                c1_jit: bool = False, zipped_pyspark: bool = False,
                class_archive: bool = False) -> list[dict]:
    """This process: a fresh session, `fits` fits; each one's phases. The session has
    SPARK_CONF (`warm_daemon`), the JVM's JIT stopped at its first tier (`c1_jit`), the
    daemon's pyspark from Spark's zip (`zipped_pyspark`), the class archive of Spark's
    classes the jobs' JVMs map (`class_archive`: recorded where there is none yet, and
    published after the session); `late_warm_up`: the end-of-fit warm-up started as training
    starts. Each fit's figures include the session's start (`session_start`: to a session
    that has run its first job)."""
    import sparkdl_avg
    from sparkdl_avg import SPARK_CONF, TrainConfig, fit
    from sparkdl_avg import _fit as fit_module
    from sparkdl_avg.driver import plan as plan_module
    from sparkdl_avg.examples import mnist1d
    from sparkdl_avg.tracking import run as run_module

    if late_warm_up:
        _late_warm_up(run_module.RunLogger)
    spent: dict = {}
    _timed(run_module.RunLogger, "__enter__", spent, "run_open")
    _timed(plan_module, "check_cluster", spent, "probe")
    _timed(plan_module, "prepare", spent, "prepare")
    _timed(run_module.RunLogger, "log_figure", spent, "log_figures")
    _timed(fit_module, "_log_model", spent, "log_model")
    conf = {**(SPARK_CONF if warm_daemon else {}), **(C1_JIT if c1_jit else {}),
            **(ZIPPED_PYSPARK if zipped_pyspark else {})}
    t0 = time.perf_counter()
    archive = None
    if class_archive:  # the library's own local session: its settings, not `conf`
        spark = sparkdl_avg.local_session(2)
        archive = "recorded" if _local_session._recording else "mapped"
    else:
        spark = local_session(2, **conf)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()  # the session is up and has run a job, as before any fit
        session_start = time.perf_counter() - t0
        cfg = TrainConfig(num_workers=2, epochs=1, batch_size=50, optimizer="adam", lr=1e-3,
                          experiment_name="bench-cold-start")
        samples = []
        for _ in range(fits):
            spent.clear()
            t0 = time.perf_counter()
            result = fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df)
            total = time.perf_counter() - t0
            t = result.timings
            samples.append({**spent, "to_first_step": t["first_step_s"] - t["validate_s"],
                            "first_step": t["first_step_s"], "train": t["train_s"],
                            "total": total, "session_start": session_start,
                            "archive": archive,
                            "library": os.path.dirname(sparkdl_avg.__file__),
                            "workers_library": result.workers[0]["library"]})
        return samples
    finally:
        spark.stop()
        _local_session.end_recording()


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worktree(rev: str) -> str:
    """A detached checkout of `rev` in a new temporary folder; its path."""
    tree = os.path.join(tempfile.mkdtemp(prefix="cold-start-against-"), "tree")
    subprocess.run(["git", "worktree", "add", "--detach", tree, rev], cwd=REPO, check=True,
                   capture_output=True)
    return tree


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3,
                        help="fresh processes of each kind of session")
    parser.add_argument("--fits", type=int, default=3, help="fits in each process")
    parser.add_argument("--fresh-store", action="store_true",
                        help="a new MLflow store for each sample")
    parser.add_argument("--late-warm-up", action="store_true",
                        help="also SPARK_CONF sessions with the warm-up started as training "
                             "starts")
    parser.add_argument("--c1-jit", action="store_true",
                        help="also SPARK_CONF sessions whose JVM compiles with C1 only "
                             "(-XX:TieredStopAtLevel=1)")
    parser.add_argument("--zipped-pyspark", action="store_true",
                        help="also SPARK_CONF sessions whose daemon imports pyspark from "
                             "Spark's pyspark.zip, as before")
    parser.add_argument("--against", metavar="REV",
                        help="also SPARK_CONF sessions running the library of commit REV")
    parser.add_argument("--class-archive", action="store_true",
                        help="also sessions of sparkdl_avg.local_session (SPARK_CONF + C1, "
                             "a JVM that maps the class archive of Spark's classes), recorded "
                             "first by one more session, reported alone")
    parser.add_argument("--one-session", choices=list(KINDS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_session:
        print(json.dumps(one_session(args.fits, **KINDS[args.one_session])))
        return
    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    if not args.fresh_store:
        import mlflow

        mlflow.MlflowClient(store).search_experiments()  # creates the store's tables
    sessions: dict[str, list] = {kind: [] for kind in KINDS if kind != "class_archive_recording"
                                 and (kind not in OPTIONAL or getattr(args, OPTIONAL[kind]))}
    kinds = list(sessions)
    # the commit, resolved once: the worktree and the result name the same one
    against = subprocess.check_output(["git", "rev-parse", "--verify", args.against], cwd=REPO,
                                      text=True).strip() if args.against else None
    tree = _worktree(against) if against else None
    archives = tempfile.mkdtemp()  # a new folder: the first class-archive session records
    if args.class_archive:
        sessions = {"class_archive_recording": [in_fresh_process(
            __file__, "--one-session", "class_archive_recording", "--fits", str(args.fits),
            env={**os.environ, "MLFLOW_TRACKING_URI": store,
                 _jvm_archive.FOLDER_ENV: archives})], **sessions}
    try:
        for i in range(args.samples):  # the kinds' order rotates: none always goes first
            for kind in kinds[i % len(kinds):] + kinds[:i % len(kinds)]:
                env = {**os.environ, "MLFLOW_TRACKING_URI": store if not args.fresh_store else
                       f"sqlite:///{tempfile.mkdtemp()}/mlflow.db",
                       _jvm_archive.FOLDER_ENV: archives}
                other = kind == "spark_conf_against"
                if other:  # the driver's path, and the executors' (a local master)
                    env["PYTHONPATH"] = os.pathsep.join(
                        p for p in (tree, os.environ.get("PYTHONPATH")) if p)
                # started in the worktree: the executors' Python puts its folder first
                sessions[kind].append(in_fresh_process(
                    __file__, "--one-session", kind, "--fits", str(args.fits), env=env,
                    cwd=tree if other else None))
    finally:
        shutil.rmtree(archives, ignore_errors=True)
        if tree is not None:
            subprocess.run(["git", "worktree", "remove", "--force", tree], cwd=REPO,
                           check=False)

    def medians(fits: list[dict]) -> dict | None:  # None: no such fit (--fits 1 has no warm)
        return {k: round(median([f.get(k, 0.0) for f in fits]), 2)
                for k in ("first_step", *PHASES)} if fits else None

    results: dict = {"fresh_store": args.fresh_store}
    if against:
        results["against"] = against
    for kind, runs in sessions.items():
        cold = [s[0] for s in runs]
        warm = [f for s in runs for f in s[1:]]
        results[kind] = {"cold_median_s": medians(cold), "warm_median_s": medians(warm),
                         "cold": cold, "warm": warm}
    report("cold_start", results)


if __name__ == "__main__":
    main()
