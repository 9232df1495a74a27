"""Shared by the benchmarks: a local[N] session, result printing, and the one place where a
bench's raw result is kept: `report` writes bench/results/<bench>-<UTC time>.json holding the
command line, the UTC date, the git commit (and the tracked files that differed from it), the
machine, and the bench's own figures under "result"."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = RESULTS.parent.parent
C1_JIT = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1"}
"""A session's settings (`local_session`) whose JVM, the driver's and a local master's
executors, compiles with C1 only: less compile work while a cold JVM runs its first jobs,
slower code where a job runs long enough for C2. `sparkdl_avg.local_session`'s JVM has it."""


def local_session(workers: int = 2, **conf: str):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = (SparkSession.builder.master(f"local[{workers}]")
               .config("spark.ui.enabled", "false")
               .config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.host", "127.0.0.1"))
    for key, value in conf.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def in_fresh_process(script: str, *args: str, env: dict | None = None,
                     python: str | None = None, cwd: str | None = None):
    """`script` run again in a process of its own with `args` (a fresh Python, a fresh
    session; `python`, else this one, started in `cwd`); what it printed last, as JSON."""
    done = subprocess.run([python or sys.executable, os.path.abspath(script), *args],
                          capture_output=True, text=True, env=env, cwd=cwd)
    if done.returncode:  # its own traceback, not only its exit status
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(values) -> float:
    return statistics.median(values)


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def _version(module: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(module)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict:
    """What the figures were measured on. The load average says how busy the machine was
    (other processes share the cores)."""
    import torch

    gpu = ([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
           if torch.cuda.is_available() else None)
    return {"cores": os.cpu_count(), "memory_gb": _memory_gb(), "cpu": _cpu_model(),
            "gpu": gpu, "python": platform.python_version(), "torch": torch.__version__,
            "pyspark": _version("pyspark"), "mlflow": _version("mlflow"),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()]}


def provenance(started: datetime.datetime | None = None) -> dict:
    """The command, date, commit and machine of a result."""
    changed = _git("diff", "--name-only", "HEAD").splitlines()
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "command": " ".join(["python", os.path.relpath(sys.argv[0], REPO), *sys.argv[1:]]),
        "started_utc": (started or now).isoformat(timespec="seconds"),
        "finished_utc": now.isoformat(timespec="seconds"),
        "git_commit": _git("rev-parse", "HEAD") or None,
        # tracked files that differed from that commit (none: the commit is the code run)
        "git_dirty": changed,
        "machine": machine(),
    }


STARTED = datetime.datetime.now(datetime.timezone.utc)  # when the bench's process started


def report(name: str, data: dict) -> Path:
    """Print `data` and keep it, with its provenance, as bench/results/<name>-<UTC>.json.
    Every bench calls this once, in its main process, with the figures docs/ quotes."""
    RESULTS.mkdir(exist_ok=True)
    meta = provenance(STARTED)
    stamp = STARTED.strftime("%Y%m%dT%H%M%SZ")
    path = RESULTS / f"{name}-{stamp}.json"
    path.write_text(json.dumps({"bench": name, **meta, "result": data}, indent=2) + "\n")
    print(json.dumps(data, indent=2))
    print(f"kept in {os.path.relpath(path, REPO)}", file=sys.stderr)
    return path
