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

import importlib.machinery
import os
import sys
import zipfile
from pathlib import Path

SPARK_ZIP = os.path.join("python", "lib", "pyspark.zip")
"""Where an installed pyspark keeps the zip of itself that Spark puts first on its Python
processes' path."""


def without_installed_spark_zip(path: list[str]) -> list[str]:
    """`path` without Spark's `pyspark.zip` where the zip is the copy an installed pyspark
    keeps of itself (pip's pyspark; `SPARK_HOME` is then its directory) and that pyspark is
    the one the rest of `path` imports: the same modules, read from their compiled bytecode.
    From the zip Python compiles each module afresh in every process (zipimport keeps no
    bytecode): 0.5 s of the daemon's start and 0.1 s of each worker's, measured on 2 cores.
    Any other zip (a Spark distribution's, as on Databricks) stays where it is."""
    for entry in path:
        if entry.endswith(os.sep + SPARK_ZIP):
            rest = [e for e in path if e != entry]
            if _imports_the_zipped_pyspark(rest, entry, package=entry[: -len(SPARK_ZIP) - 1]):
                return rest
    return path


def _imports_the_zipped_pyspark(path: list[str], zipped: str, package: str) -> bool:
    """Whether `path` imports pyspark from `package`, the pyspark `zipped` was made of."""
    spec = importlib.machinery.PathFinder.find_spec("pyspark", path)
    if spec is None or spec.origin is None:
        return False
    try:
        if not os.path.samefile(os.path.dirname(spec.origin), package):
            return False
        with zipfile.ZipFile(zipped) as archive:  # read only for the package it came with
            return archive.read("pyspark/version.py") == Path(package, "version.py").read_bytes()
    except (OSError, KeyError, zipfile.BadZipFile):
        return False


if __name__ == "__main__":
    sys.path[:] = without_installed_spark_zip(sys.path)  # before anything imports pyspark
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
