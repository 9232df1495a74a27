"""Spark's Python daemon with torch already imported: `spark.python.daemon.module` set to
this module (`sparkdl_avg.SPARK_CONF`) makes every Python worker the executor forks start
with torch, its optimizers' machinery and the training task's modules loaded.

Without it each new worker imports torch itself (1.5-3 s a worker, more when two start at
once on a busy machine), at every session's first fit and whenever Spark starts workers
afresh. With it the daemon imports them once, at its own start, and the workers it forks
share those pages.

`pyspark.daemon` forks only after its own start because a module that starts threads at
import does not survive a fork. torch and the modules below start none (numpy's OpenBLAS
pool is made fork-safe by OpenBLAS itself); pyarrow and pandas, which do, are not imported
here. If an import fails the daemon serves anyway and the task imports on its own, where
the failure is reported with the task. This module itself must be importable by the
executors' Python without `--py-files` (those reach a worker's path only after the fork).
"""

from __future__ import annotations

if __name__ == "__main__":
    from sparkdl_avg.task.probe import import_for_training

    preloaded = import_for_training()  # workers forked below inherit it, and the modules
    import gc

    # The imports' objects are permanent: the workers' collections skip them (a full one
    # takes 0.15 s with torch loaded, at every task's end: `memory.release_task_memory`)
    # and so never write to the pages the workers share with the daemon.
    gc.freeze()
    frozen = gc.get_freeze_count()
    from pyspark import daemon

    daemon.manager()
