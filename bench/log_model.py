"""Seconds to log a fit's model to MLflow after its last round, for the models the docs train:
the MNIST-1D job's MLP, a small GRU over the same 40 features read as a sequence (issue 39's
case), the char-LM transformer and the images CNN. No Spark: the schema is the one a fit of
that data would learn.

One fresh process per sample and model, which first does what a fit does before its first
Spark job (`tracking/first_use.pay`: torch.export's and MLflow's first use), then logs the model
three ways:

- ahead, first: as a fit does now (`tracking/model_ahead`): the initial model saved with its
  export (`ahead_save_s`, paid beside training, off the fit's critical path), the parameters
  then changed as training would, and the trained model logged from that saving (`log_s`);
- fresh: `tracking.model.log_model` exporting the model after training, as fits did before;
- ahead, again: the first way a second time (warm).

Each log also counts the Python warnings, the bytes written to stderr (MLflow's progress bars
go there), the torch.export calls and the artifacts downloaded back.

    python bench/log_model.py [--samples 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, median, report  # noqa: E402

MODELS = ("mlp", "gru", "char_transformer", "cnn")


def _model_and_schema(kind: str):
    import torch

    from sparkdl_avg.data.schema import DataSchema, FieldSpec
    from sparkdl_avg.examples import char_lm, digits_images, mnist1d

    def schema(dtype, shape):
        field = FieldSpec(role="input", name="x", column="x", wire="_x", dtype=dtype,
                          shape=shape, source="array")
        return DataSchema(inputs=(field,), binding="single", labels=(), label_list=False)

    class GRU(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru, self.out = torch.nn.GRU(1, 32, batch_first=True), torch.nn.Linear(32, 10)

        def forward(self, x):
            return self.out(self.gru(x.unsqueeze(-1))[0][:, -1])

    if kind == "mlp":
        return mnist1d.mlp()(), schema("float32", (40,))
    if kind == "gru":
        return GRU(), schema("float32", (40,))
    if kind == "char_transformer":
        return char_lm.transformer()(), schema("int64", (128,))
    return digits_images.cnn()(), schema("float32", (1, 8, 8))


def one_process(kind: str) -> list[dict]:
    """This process: log `kind`'s model twice (cold, warm); each log's figures."""
    import io
    import warnings
    from contextlib import redirect_stderr

    import mlflow
    import torch
    from mlflow.store.artifact.artifact_repo import ArtifactRepository

    from sparkdl_avg.tracking.model import log_model

    counts = {"exports": 0, "downloads": 0}
    export, download = torch.export.export, ArtifactRepository.download_artifacts

    def counted_export(*args, **kwargs):
        counts["exports"] += 1
        return export(*args, **kwargs)

    def counted_download(self, *args, **kwargs):
        counts["downloads"] += 1
        return download(self, *args, **kwargs)

    torch.export.export, ArtifactRepository.download_artifacts = counted_export, \
        counted_download
    mlflow.set_experiment("bench-log-model")
    from sparkdl_avg.tracking.first_use import pay
    from sparkdl_avg.tracking.model_ahead import SavedAhead

    pay(True)  # what a fit pays beside its first Spark job
    logs = []
    for way in ("ahead", "fresh", "ahead"):
        model, schema = _model_and_schema(kind)
        model.eval()
        ahead, ahead_save_s = None, None
        if way == "ahead":
            t0 = time.perf_counter()
            ahead = SavedAhead(model, schema=schema, heads=("class",),
                               pip_requirements=["torch"])
            ahead.save()
            ahead_save_s = time.perf_counter() - t0
        with torch.no_grad():  # what training changes
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)
        counts.update(exports=0, downloads=0)
        err = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, redirect_stderr(err):
            warnings.simplefilter("always")
            t0 = time.perf_counter()
            with mlflow.start_run():
                log_model(model, schema=schema, heads=("class",),
                          pip_requirements=["torch"], ahead=ahead)
            seconds = time.perf_counter() - t0
        if ahead is not None:
            ahead.close()
        logs.append({"way": way, "log_s": seconds, "ahead_save_s": ahead_save_s,
                     "warnings": [str(w.message)[:120] for w in caught],
                     "stderr_bytes": len(err.getvalue()), **counts})
    return logs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3, help="fresh processes per model")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--one-process", choices=MODELS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_process:
        print(json.dumps(one_process(args.one_process)))
        return
    store = f"sqlite:///{tempfile.mkdtemp()}/mlflow.db"
    import mlflow

    mlflow.MlflowClient(store).search_experiments()  # creates the store's tables
    env = {**os.environ, "MLFLOW_TRACKING_URI": store}
    runs: dict[str, list] = {kind: [] for kind in args.models}
    for _ in range(args.samples):
        for kind in args.models:
            runs[kind].append(in_fresh_process(__file__, "--one-process", kind, env=env))
    results = {}
    for kind, samples in runs.items():
        first, fresh, again = ([s[i] for s in samples] for i in range(3))
        every = first + fresh + again

        def med(logs, key="log_s"):
            return round(median([s[key] for s in logs]), 3)

        results[kind] = {
            "ahead_first_median_s": med(first), "fresh_median_s": med(fresh),
            "ahead_again_median_s": med(again),
            "ahead_save_median_s": med(first + again, "ahead_save_s"),
            "fresh_over_ahead": med(fresh) / med(again),
            "warnings": sorted({w for s in every for w in s["warnings"]}),
            "stderr_bytes_max": max(s["stderr_bytes"] for s in every),
            "exports_after_training": {way: max(s["exports"] for s in logs) for way, logs in
                                       (("ahead", first + again), ("fresh", fresh))},
            "downloads_max": max(s["downloads"] for s in every),
            "logs": samples}
    report("log_model", results)


if __name__ == "__main__":
    main()
