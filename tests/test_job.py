"""The jobs under plain python (spark-submit to a standalone cluster: test_standalone)."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).resolve().parents[1] / "jobs"
JOB = JOBS / "train_mnist1d.py"
SMALL = ["--samples", "3000", "--epochs", "3", "--hidden", "64", "--lr", "3e-3",
         "--no-log-model"]


# The job's script run with the project's own warnings (the package's and the job's) made
# errors: a warning the job could cause and a user could not act on fails it.
STRICT = ("import runpy, sys, warnings; "
          "warnings.filterwarnings('error', module=r'(sparkdl_avg(\\.|$)|__main__$)'); "
          "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
# A Python warning as `warnings` prints it (torch.export's, MLflow's, pandas', on the driver
# or from an executor's Python worker, whose stderr the local JVM passes on), a Spark log
# line at WARN, or a Python log record at WARNING in the jobs' logging format
# ("%(asctime)s %(levelname)s %(message)s": the package's own log.warning), or the JVM's own
# "WARNING: ..." (the main job filters the incubator-module line Spark's launcher causes).
WARNING_LINE = re.compile(r"\b[A-Z]\w*Warning: | WARN(ING)? |^WARNING: ")


def run_job(cmd: list[str], tmp_path: Path, tracking_uri: str, small: list[str] | None = None,
            quiet: bool = False) -> str:
    """The job's stdout; `quiet`: run under STRICT, and no warning printed on either stream."""
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "MLFLOW_TRACKING_URI": tracking_uri}
    small = SMALL + ["--data-dir", str(tmp_path.parent / "data")] if small is None else small
    if quiet:
        cmd = [cmd[0], "-c", STRICT, *cmd[1:]]
    proc = subprocess.run(cmd + small, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    if quiet:
        printed = [line for line in (proc.stdout + proc.stderr).splitlines()
                   if WARNING_LINE.search(line)]
        assert not printed, printed
    return proc.stdout


def check_output(stdout: str, client, **params: str) -> str:
    """The run's id, once its output and MLflow run are checked."""
    match = re.search(r"test accuracy (\S+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    assert float(match.group(1)) > 0.3  # 10 classes: well above chance after 3 epochs
    run = client.get_run(match.group(2))
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3"
    for name, value in params.items():
        assert run.data.params[name] == value
    return run.info.run_id


@pytest.mark.cluster
def test_job_runs_with_plain_python_and_prints_no_warning(tmp_path, mlflow_store,
                                                         mlflow_client):
    """The main job, logging its model as the README's command does (torch.export's pt2),
    with its warnings made errors and none printed."""
    ckpt = tmp_path / "ckpt"
    # overlapped rounds (checkpoint rounds wait): the job's flag reaches the fit
    cmd = [sys.executable, str(JOB), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
           "--overlap-averaging"]
    logged = [a for a in SMALL if a != "--no-log-model"]
    run_id = check_output(run_job(cmd, tmp_path, mlflow_store,
                                  logged + ["--data-dir", str(tmp_path.parent / "data")],
                                  quiet=True),
                          mlflow_client, overlap_averaging="True")
    data = {a.path.rsplit("/", 1)[-1] for a in mlflow_client.list_artifacts(run_id, "model/data")}
    assert "model.pt2" in data and "model.pth" not in data  # torch.export's, not pickled
    rounds = sorted(p.name for p in ckpt.glob("round-*"))
    assert len(rounds) == 2  # the newest two are kept
    assert all((ckpt / r / "checkpoint.json").exists() for r in rounds)


@pytest.mark.cluster
def test_char_lm_job_beats_the_unigram_baseline(tmp_path, mlflow_store, mlflow_client):
    """A short run on 120 kB of the stdlib's sources learns from the context: its held-out
    bits per byte are below the unigram baseline's (about 4.4 bits), as logged to MLflow,
    beside the samples it wrote."""
    small = ["--max-bytes", "120000", "--seq-len", "64", "--epochs", "2", "--d-model", "64",
             "--sample-bytes", "40", "--no-log-model"]
    stdout = run_job([sys.executable, str(JOBS / "train_char_lm.py")], tmp_path, mlflow_store,
                     small)
    match = re.search(r"bits per byte (\S+)  unigram (\S+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    bpb, unigram, run_id = float(match.group(1)), float(match.group(2)), match.group(3)
    assert 3.5 < unigram < 5.5  # source code: about 4.4 bits a byte
    assert bpb < unigram - 0.3
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["bits_per_byte"] == pytest.approx(bpb, abs=1e-3)
    assert run.data.metrics["unigram_bits_per_byte"] == pytest.approx(unigram, abs=1e-3)
    samples = Path(mlflow_client.download_artifacts(run_id, "samples.txt", str(tmp_path)))
    assert samples.read_text().count("--- ") == 3  # one sample a default prompt


@pytest.mark.cluster
def test_finetune_lm_job_lowers_perplexity_moving_only_adapters(tmp_path, mlflow_store,
                                                                 mlflow_client):
    """A tiny run of the fine-tuning job: pretrained on the stdlib's sources, LoRA on its
    English lowers the held-out English perplexity, and the fine-tune's rounds move the
    adapters' bytes through the driver, not the model's: the ratio of the two fits' driver
    MB is about that of their trained parameters. Both fits are children of the job's run,
    which holds the report and the pretrained model; the fine-tune's run holds the
    adapters."""
    pytest.importorskip("peft")
    small = ["--pretrain-bytes", "40000", "--max-bytes", "40000", "--seq-len", "64",
             "--pretrain-epochs", "1", "--pretrain-lr", "3e-3", "--epochs", "2", "--lr", "1e-2",
             "--d-model", "64", "--heads", "2", "--layers", "2", "--rank", "4",
             "--averaging-frequency", "4", "--batch-size", "16"]
    stdout = run_job([sys.executable, str(JOBS / "finetune_lm.py")], tmp_path, mlflow_store,
                     small)
    match = re.search(r"perplexity before (\S+)  after (\S+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    before, after, run_id = float(match.group(1)), float(match.group(2)), match.group(3)
    assert after < 0.95 * before  # 32.4 to 27.9 with torch 2.13 on the CPU
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    report = run.data.metrics
    assert report["perplexity_before"] == pytest.approx(before, abs=1e-3)
    # LoRA rank 4 on c_attn (64 -> 192) and c_fc (64 -> 256), 2 layers
    assert report["trainable_params"] == 2 * 4 * ((64 + 192) + (64 + 256))
    whole = report["total_params"] - report["trainable_params"]  # what pretraining averaged
    ratio = report["driver_mb_pretrain"] / report["driver_mb_finetune"]
    assert 0.5 < ratio / (whole / report["trainable_params"]) < 1.5
    children = mlflow_client.search_runs(
        [run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    assert sorted(c.info.status for c in children) == ["FINISHED", "FINISHED"]
    # the pretrained model beside the report, the adapters in the fine-tune's run
    assert "pretrained/config.json" in {a.path for a in mlflow_client.list_artifacts(
        run_id, "pretrained")}
    logged = [[a.path for a in mlflow_client.list_artifacts(c.info.run_id, "adapters")]
              for c in children]
    assert sorted(map(bool, logged)) == [False, True]


def load_job(name: str):
    spec = importlib.util.spec_from_file_location(name, JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_images_job_reads_digits_by_default_and_any_folder_with_data():
    job = load_job("train_images")
    default = job.parse_args([])
    assert default.data is None and default.max_images is None  # all the digits, written
    assert (default.size, default.channels, default.max_shift) == (8, 1, 1)  # digits: 8x8
    given = job.parse_args(["--data", "/images", "--size", "64", "--channels", "3",
                            "--max-shift", "4", "--preprocess-threads", "3"])
    assert (given.data, given.size, given.channels, given.max_shift,
            given.preprocess_threads) == ("/images", 64, 3, 4, 3)
    with pytest.raises(SystemExit):
        job.parse_args(["--channels", "2"])


def fit_has_preprocess() -> bool:
    from sparkdl_avg import fit

    return "preprocess" in inspect.signature(fit).parameters


@pytest.mark.cluster
@pytest.mark.skipif(not fit_has_preprocess(),
                    reason="needs fit(preprocess=) and binary columns (issue 31's core)")
def test_images_job_learns_the_digits_from_png_files(tmp_path, mlflow_store, mlflow_client):
    """600 of scikit-learn's digits written as PNG files, read as bytes by binaryFile,
    decoded and shifted in preprocess: a few epochs of the small CNN classify the held-out
    files well above chance (10%), and the run is logged."""
    small = ["--max-images", "600", "--epochs", "4", "--eval-percent", "20", "--no-log-model"]
    stdout = run_job([sys.executable, str(JOBS / "train_images.py")], tmp_path, mlflow_store,
                     small)
    match = re.search(r"test accuracy (\S+) .* classes (\d+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    assert float(match.group(1)) > 0.6 and match.group(2) == "10"
    run = mlflow_client.get_run(match.group(3))
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "4"
