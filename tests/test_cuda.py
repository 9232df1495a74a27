"""Fits on a real GPU: a standalone cluster on loopback whose workers report the machine's
GPU 0, driven by `cuda_fits.py` in its own process. Each claim is checked against an
independent computation or a repeat. Runs only where torch sees CUDA (docs/guide/gpus.md: where
it last ran, and what it gave)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

SCRIPT = Path(__file__).with_name("cuda_fits.py")


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    from standalone_cluster import StandaloneCluster

    with StandaloneCluster(tmp_path_factory.mktemp("gpu-cluster"), workers=2, cores=1,
                           memory="4g", real_gpu=True) as cluster:
        yield cluster


def run_driver(cluster, tmp_path, what: str) -> dict:
    out = tmp_path / f"{what}.json"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out), cluster.url, what],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def fits(gpu_cluster, tmp_path_factory):
    return run_driver(gpu_cluster, tmp_path_factory.mktemp("fits"), "fits")


def on_the_gpu(workers: list[dict]) -> bool:
    return [(w["device"].split(":")[0], w["gpu"]) for w in workers] == [("cuda", "0")]


def test_float64_sgd_on_the_gpu_equals_large_batch_sgd_on_the_cpu(fits):
    f64 = fits["float64"]
    assert on_the_gpu(f64["workers"]), f64["workers"]
    assert f64["rounds"] == 2 * -(-411 // 8)
    assert f64["diff"] < 1e-10
    assert f64["moved"] > 1e-2


def test_deterministic_fits_repeat_bit_for_bit_from_either_cache(fits):
    det = fits["deterministic"]
    assert on_the_gpu(det["workers"]), det["workers"]
    assert det["repeat_identical"]
    assert det["disk_identical"]
    assert det["losses"][-1] < 0.5 * det["losses"][0]


@pytest.mark.parametrize("mode", ["bf16", "fp16", "async"])
def test_mixed_precision_and_async_fits_learn_on_the_gpu(fits, mode):
    run = fits[mode]
    assert on_the_gpu(run["workers"]), run["workers"]
    assert all(loss == loss for loss in run["losses"])  # no NaN
    assert run["losses"][-1] < 0.6 * run["losses"][0]


def test_two_tasks_handed_one_gpu_are_refused(fits):
    assert fits["shared_gpu"] is not None
    assert fits["shared_gpu"].startswith("ClusterError: partition "), fits["shared_gpu"]
    assert "tasks 0 and 1" in fits["shared_gpu"], fits["shared_gpu"]


def test_scoring_runs_on_the_tasks_gpu_and_matches_the_cpu(gpu_cluster, tmp_path):
    scoring = run_driver(gpu_cluster, tmp_path, "scoring")
    assert on_the_gpu(scoring["workers"]), scoring["workers"]
    assert scoring["rows"] == 2000
    assert scoring["devices"] == ["cuda:0"]
    assert scoring["max_abs_diff"] < 1e-4
