"""Shared by the benchmarks: a local[N] session and result printing."""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


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


def in_fresh_process(script: str, *args: str, env: dict | None = None):
    """`script` run again in a process of its own with `args` (a fresh Python, a fresh
    session); what it printed last, as JSON."""
    import subprocess

    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median(values) -> float:
    return statistics.median(values)


def report(name: str, data: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(data, indent=2))
    print(json.dumps(data, indent=2))
