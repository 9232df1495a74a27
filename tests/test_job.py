"""The four jobs under plain python, in one process (spark-submit to a standalone cluster:
test_standalone): each learns at toy size, logs its run, and prints no warning."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sparkdl_avg._local_session import LOG4J

JOBS = Path(__file__).resolve().parents[1] / "jobs"
PEFT = importlib.util.find_spec("peft") is not None  # the fine-tuning job needs the hf extra


def small_runs(tmp: Path) -> dict[str, list[str]]:
    """Each job at toy size, a few seconds of training each: the main job logs its model as
    the README's command does (torch.export's pt2) and checkpoints its overlapped rounds."""
    runs = {
        "train_mnist1d": ["--samples", "3000", "--epochs", "3", "--hidden", "64",
                          "--lr", "3e-3", "--data-dir", str(tmp / "data"),
                          "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", "5",
                          "--overlap-averaging"],
        "train_images": ["--max-images", "600", "--epochs", "4", "--eval-percent", "20",
                         "--no-log-model"],
        "train_char_lm": ["--max-bytes", "120000", "--seq-len", "64", "--epochs", "2",
                          "--d-model", "64", "--sample-bytes", "40", "--no-log-model"],
        "finetune_lm": ["--pretrain-bytes", "40000", "--max-bytes", "40000", "--seq-len", "64",
                        "--pretrain-epochs", "1", "--pretrain-lr", "3e-3", "--epochs", "2",
                        "--lr", "1e-2", "--d-model", "64", "--heads", "2", "--layers", "2",
                        "--rank", "4", "--averaging-frequency", "4", "--batch-size", "16"],
    }
    if not PEFT:
        del runs["finetune_lm"]
    return runs


# The jobs run one after another in one process, as `python jobs/<job>.py ...` runs each (its
# folder first on sys.path), with the project's own warnings (the package's and the jobs')
# made errors: a warning a job could cause and a user could not act on fails it. The first
# job's JVM records the class archive of Spark's classes (the archive folder is new) and ends
# with its session, to write it; the second job's JVM maps it, and each later job's session
# is a new SparkContext in that JVM.
RUN_IN_TURN = """
import json, os, runpy, sys, warnings
warnings.filterwarnings('error', module=r'(sparkdl_avg(\\.|$)|__main__$)')
for name, script, args in json.loads(sys.argv[1]):
    for stream in (sys.stdout, sys.stderr):
        print(f'=== {name}', file=stream, flush=True)
    sys.argv, sys.path[0] = [script, *args], os.path.dirname(script)
    try:
        runpy.run_path(script, run_name='__main__')
    except SystemExit as exc:
        if exc.code:
            raise
from pyspark import SparkContext  # the JVM the second job started, which outlives its session
jvm_args = SparkContext._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean()
with open('jvm-options.txt', 'w') as f:
    f.write(' '.join(jvm_args.getInputArguments().toArray()))
pid = SparkContext._jvm.java.lang.ProcessHandle.current().pid()
with open(f'/proc/{pid}/maps') as maps, open('jvm-mapped.txt', 'w') as f:
    f.write(' '.join(sorted({line.split()[-1] for line in maps if line.endswith('.jsa\\n')})))
"""
# A Python warning as `warnings` prints it (torch.export's, MLflow's, pandas', on the driver
# or from an executor's Python worker, whose stderr the local JVM passes on), a Spark log
# line at WARN, or a Python log record at WARNING in the jobs' logging format
# ("%(asctime)s %(levelname)s %(message)s": the package's own log.warning), transformers'
# own log line ("[transformers] ...", which it prints from WARNING up), or the JVM's own
# "WARNING: ..." (the jobs filter the incubator-module line Spark's launcher causes) or its
# unified log's "[0.1s][warning][cds] ..." (a recording JVM's notes on classes it skips).
WARNING_LINE = re.compile(
    r"\b[A-Z]\w*Warning: | WARN(ING)? |^WARNING: |^\[transformers\] |\]\[warning\]\[")


@pytest.fixture(scope="module")
def jobs_run(tmp_path_factory, mlflow_store) -> tuple[dict[str, str], dict[str, str], Path]:
    """Each job's stdout and stderr, by name, and the folder they ran in. No PYSPARK_PYTHON:
    a local session's executors run the driver's Python by the library's own default."""
    tmp = tmp_path_factory.mktemp("jobs")
    runs = [(name, str(JOBS / f"{name}.py"), args) for name, args in small_runs(tmp).items()]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env.update(SPARK_LOCAL_IP="127.0.0.1", MLFLOW_TRACKING_URI=mlflow_store,
               SPARKDL_AVG_JVM_ARCHIVES=str(tmp / "jvm-archives"))
    proc = subprocess.run([sys.executable, "-c", RUN_IN_TURN, json.dumps(runs)], env=env,
                          cwd=tmp, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return split_by_job(proc.stdout), split_by_job(proc.stderr), tmp


def split_by_job(text: str) -> dict[str, str]:
    parts = re.split(r"^=== (\w+)\n", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


@pytest.mark.cluster
def test_every_job_prints_no_warning(jobs_run):
    """Run with their warnings made errors, none of the jobs prints one, on either stream."""
    stdout, stderr, _ = jobs_run
    assert set(stdout) == set(small_runs(Path())), stdout.keys()  # every job ran
    printed = {name: [line for line in (stdout[name] + stderr[name]).splitlines()
                      if WARNING_LINE.search(line)] for name in stdout}
    assert not any(printed.values()), printed


@pytest.mark.cluster
def test_a_jvm_the_jobs_start_logs_by_their_settings_and_compiles_with_c1_only(jobs_run):
    """The JVM the jobs started under plain `python` (`sparkdl_avg.local_session`'s): log4j
    from `_local_session.LOG4J`, and the JIT's first tier only (a cold JVM's compile work
    cut)."""
    options = (jobs_run[2] / "jvm-options.txt").read_text().split()
    assert f"-Dlog4j2.configurationFile={LOG4J}" in options, options
    assert "-XX:TieredStopAtLevel=1" in options, options


@pytest.mark.cluster
def test_the_first_jobs_jvm_records_sparks_classes_and_the_next_jobs_jvm_maps_them(jobs_run):
    """The class archive (`sparkdl_avg._jvm_archive`): the first job's JVM, with none in the
    folder, records one and writes it as it exits after the job; the second job's JVM is
    given it and has it mapped (its memory maps name the file), so it loads Spark's classes
    from it instead of from the jars."""
    _, stderr, tmp = jobs_run
    archives = list((tmp / "jvm-archives").iterdir())
    assert len(archives) == 1 and archives[0].suffix == ".jsa", archives  # nothing half-done
    assert archives[0].stat().st_size > 50e6  # Spark's classes, not only the JDK's (13 MB)
    assert f"JVM class archive {archives[0]} written" in stderr["train_mnist1d"]
    options = (tmp / "jvm-options.txt").read_text().split()
    assert f"-XX:SharedArchiveFile={archives[0]}" in options, options
    assert str(archives[0]) in (tmp / "jvm-mapped.txt").read_text().split()


@pytest.mark.cluster
def test_main_job_learns_and_logs_its_model_as_pt2(jobs_run, mlflow_client):
    """The main job's flags reach the fit (overlapped rounds, checkpoints: the newest two
    kept), and its model is logged as torch.export's pt2, not pickled."""
    stdout, _, tmp = jobs_run
    match = re.search(r"test accuracy (\S+) .* MLflow run (\w+)", stdout["train_mnist1d"])
    assert match, stdout["train_mnist1d"]
    assert float(match.group(1)) > 0.3  # 10 classes: well above chance after 3 epochs
    run = mlflow_client.get_run(match.group(2))
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3"
    assert run.data.params["overlap_averaging"] == "True"
    assert mlflow_client.get_metric_history(run.info.run_id, "wire_mb")
    data = {a.path.rsplit("/", 1)[-1]
            for a in mlflow_client.list_artifacts(run.info.run_id, "model/data")}
    assert "model.pt2" in data and "model.pth" not in data
    ckpt = tmp / "ckpt"
    rounds = sorted(p.name for p in ckpt.glob("round-*"))
    assert len(rounds) == 2  # the newest two are kept
    assert all((ckpt / r / "checkpoint.json").exists() for r in rounds)


@pytest.mark.cluster
def test_char_lm_job_beats_the_unigram_baseline(jobs_run, mlflow_client, tmp_path):
    """A short run on 120 kB of the stdlib's sources learns from the context: its held-out
    bits per byte are below the unigram baseline's (about 4.4 bits), as logged to MLflow,
    beside the samples it wrote."""
    stdout = jobs_run[0]["train_char_lm"]
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
@pytest.mark.skipif(not PEFT, reason="needs peft (the hf extra)")
def test_finetune_lm_job_lowers_perplexity_moving_only_adapters(jobs_run, mlflow_client):
    """A tiny run of the fine-tuning job: pretrained on the stdlib's sources, LoRA on its
    English lowers the held-out English perplexity, and the fine-tune's rounds move the
    adapters' bytes through the driver, not the model's: the ratio of the two fits' driver
    MB is about that of their trained parameters. Both fits are children of the job's run,
    which holds the report and the pretrained model; the fine-tune's run holds the
    adapters."""
    stdout = jobs_run[0]["finetune_lm"]
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
    if str(JOBS) not in sys.path:  # as `python jobs/<job>.py` has it: the jobs' `_job`
        sys.path.insert(0, str(JOBS))
    spec = importlib.util.spec_from_file_location(name, JOBS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_job_passes_the_averaging_flags_on_and_only_the_given_ones():
    job = load_job("train_mnist1d")
    given = job.train_config(job.parse_args([
        "--averaging-frequency", "32", "--outer-optimizer", "nesterov", "--outer-lr", "0.5",
        "--averaging-warmup-steps", "10", "--delta-compression", "int4"]))
    assert (given.averaging_frequency, given.outer_optimizer, given.outer_lr,
            given.outer_momentum, given.averaging_warmup_steps, given.delta_compression) == \
        (32, "nesterov", 0.5, None, 10, "int4")
    plain = job.train_config(job.parse_args([]))
    assert (plain.outer_optimizer, plain.delta_compression) == ("average", "none")
    with pytest.raises(Exception, match="outer_optimizer"):  # TrainConfig's refusal
        job.train_config(job.parse_args(["--mode", "async", "--outer-optimizer", "nesterov"]))


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


@pytest.mark.cluster
def test_images_job_learns_the_digits_from_png_files(jobs_run, mlflow_client):
    """600 of scikit-learn's digits written as PNG files, read as bytes by binaryFile,
    decoded and shifted in preprocess: a few epochs of the small CNN classify the held-out
    files well above chance (10%), and the run is logged."""
    stdout = jobs_run[0]["train_images"]
    match = re.search(r"test accuracy (\S+) .* classes (\d+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    assert float(match.group(1)) > 0.6 and match.group(2) == "10"
    run = mlflow_client.get_run(match.group(3))
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "4"
