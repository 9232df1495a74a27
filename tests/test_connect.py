"""Spark Connect: the session-kind tests (test_sessions) and the quickstart notebook, run in a
pytest process of their own against a Connect server in a process of its own (started here,
stopped on every path). A Connect session in this process would flip `is_remote()` for the
whole of it and hide classic-only calls."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from connect_server import ConnectServer
from faulty import dataset
from test_sessions import parameters, sync_fit

TESTS = Path(__file__).parent


@pytest.mark.cluster
@pytest.mark.core
def test_the_session_tests_and_the_quickstart_pass_on_spark_connect(spark, tmp_path, request):
    """The inner run selects as this one did: `-m core` (CI's lowest pyspark line) runs only
    test_sessions' core tests there, and so no notebook."""
    markexpr = request.config.getoption("markexpr")
    reference = tmp_path / "classic.npz"
    np.savez(reference, **parameters(sync_fit(dataset(spark).cache()).model))
    with ConnectServer(tmp_path / "server") as server:
        env = {**os.environ, "SPARKDL_AVG_TEST_CONNECT": server.url,
               "SPARKDL_AVG_TEST_REFERENCE": str(reference)}
        env.pop("MLFLOW_TRACKING_URI", None)  # the inner session makes its own store
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
             *(["-m", markexpr] if markexpr else []),
             "--durations=5", str(TESTS / "test_sessions.py"),
             f"{TESTS / 'test_notebooks.py'}::test_notebook_runs_cell_by_cell[quickstart]"],
            cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout
