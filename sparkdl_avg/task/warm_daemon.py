"""Spark's Python daemon with torch already imported: `spark.python.daemon.module` set to
this module (`sparkdl_avg.SPARK_CONF`) makes every Python worker the executor forks start
with torch, its optimizers' machinery and the training task's modules loaded.

Without it each new worker imports torch itself (1.5-3 s a worker, more when two start at
once on a busy machine), at every session's first fit and whenever Spark starts workers
afresh. With it the daemon imports them once, at its own start, and the workers it forks
share those pages.

A module that starts threads at import survives the fork only where it starts them again
in the child: of what is imported here, numpy (OpenBLAS's pool) and pyarrow start one each,
and both register at-fork handlers for that; torch and the task's modules start none. No
task needs pandas (`task.report`, `data.arrow_columns.as_numpy`), so no worker imports it.
If an import fails the daemon serves anyway and the task imports on its own, where
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


def without_jars_of_no_python(path: list[str]) -> list[str]:
    """`path` without the jars on it that hold no Python module. Spark puts the jar of its
    own core on its Python processes' path (a legacy of builds that packed pyspark into it:
    pip's pyspark 4.3 has 5,973 entries there, none of them Python). Nothing is imported
    from it, but each worker's first task reads its whole directory again: Spark calls
    `importlib.invalidate_caches` once it has put the task's files on the path, and the
    zipimport of Python 3.10 and 3.11 re-reads every archive it has a finder for (0.2 s
    alone, 0.4-0.55 s while two workers start at once on 2 cores; 3.12 defers it). A jar
    that cannot be read stays, as Spark put it."""
    return [e for e in path if not (e.endswith(".jar") and not _holds_python(e))]


def _holds_python(archive: str) -> bool:
    try:
        with zipfile.ZipFile(archive) as jar:
            return any(name.endswith(PYTHON_SUFFIXES) for name in jar.namelist())
    except (OSError, zipfile.BadZipFile):
        return True


PYTHON_SUFFIXES = (".py", ".pyc", ".so", ".pyd")
"""What an importable module in an archive ends with."""


def forget_archives_off(path: list[str]) -> None:
    """Drop the cached finders of archives not on `path`: those of the entries dropped above,
    which Python's start looked into before this module could drop them. The workers'
    `invalidate_caches` then has no directory of theirs to read again."""
    import zipimport

    for entry, finder in list(sys.path_importer_cache.items()):
        if isinstance(finder, zipimport.zipimporter) and finder.archive not in path:
            del sys.path_importer_cache[entry]


if __name__ == "__main__":
    # before anything imports pyspark
    sys.path[:] = without_jars_of_no_python(without_installed_spark_zip(sys.path))
    forget_archives_off(sys.path)
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
