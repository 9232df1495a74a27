"""Subprocesses a test module waits on, started as soon as collection has selected that
module's tests (conftest's `pytest_collection_finish`), so that their waits (JVM starts,
Spark's task retries, timeouts they test) overlap the rest of the suite instead of adding to
it. Each writes its output where its fixture reads it, to an MLflow store of its own; a run
that selects none of its tests starts nothing, and a fixture whose process was not started
early (the module run alone after all) starts it then. Every process is ended with the
session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).parent


@dataclass
class Early:
    proc: subprocess.Popen
    folder: Path
    store: str
    """The MLflow tracking URI the process logs to."""

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode,
                                           (self.folder / "stdout").read_text(),
                                           (self.folder / "stderr").read_text())


def _elastic_fits(folder: Path) -> list[str]:
    from test_elastic import FITS

    return [sys.executable, str(TESTS / "elastic_fits.py"), str(folder / "fits.jsonl"), *FITS]


def _cluster_fits(folder: Path) -> list[str]:
    return [sys.executable, str(TESTS / "cluster_fits.py"), str(folder / "fits.json"), "own"]


COMMANDS = {"test_elastic.py": _elastic_fits, "test_gpu_assignment.py": _cluster_fits}
"""Per test module: the command its fixture waits on, given the folder it writes to."""
_running: dict[str, Early] = {}


def start(module: str) -> Early:
    """`module`'s process (started now unless it already runs)."""
    if module not in _running:
        folder = Path(tempfile.mkdtemp(prefix=f"sparkdl-avg-early-{Path(module).stem}-"))
        store = f"sqlite:///{folder}/mlflow.db"
        env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
               "MLFLOW_TRACKING_URI": store}
        argv = COMMANDS[module](folder)
        with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=err, cwd=TESTS.parent)
        _running[module] = Early(proc, folder, store)
    return _running[module]


def start_selected(items) -> None:
    """Start the process of every module in COMMANDS with a selected cluster test."""
    for module in COMMANDS:
        if any(Path(str(item.fspath)).name == module and item.get_closest_marker("cluster")
               for item in items):
            start(module)


def stop_all() -> None:
    for early in _running.values():
        if early.proc.poll() is None:
            early.proc.kill()
            early.proc.wait(30)
        shutil.rmtree(early.folder, ignore_errors=True)
