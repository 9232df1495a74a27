"""The fit's DataFrames as MLflow dataset inputs (contexts "training" and "evaluation"), so
the runs table's Datasets column shows them. Built from what validation already learned
(the row counts) and what the DataFrame's plan says (schema, input files): no job of its
own. `mlflow.data.from_spark` would profile the DataFrame with a row-by-row job competing
with training for the slots."""

from __future__ import annotations

import hashlib
import json
import logging
import os

log = logging.getLogger("sparkdl_avg")


def dataset_entity(df, rows: int, fallback_name: str):
    """An `mlflow.entities.Dataset` for `df`: named after its files' folder (else
    `fallback_name`), its digest a hash of schema, source and row count."""
    from mlflow.entities import Dataset

    try:
        files = list(df.inputFiles())
    except Exception:  # noqa: BLE001 - a source without files (in memory, a table of views)
        files = []
    folder = os.path.commonpath(files) if files else None
    if folder and len(files) == 1:
        folder = os.path.dirname(folder)
    source = {"path": folder, "files": len(files)}
    schema = None
    try:
        import warnings

        from mlflow.types.utils import _infer_schema

        with warnings.catch_warnings():  # its hint about integer columns is for model inputs
            warnings.simplefilter("ignore", UserWarning)
            schema = json.dumps({"mlflow_colspec": _infer_schema(df).to_dict()})
    except Exception:  # noqa: BLE001 - the table shows the dataset without a schema
        log.debug("no MLflow schema for %s", fallback_name, exc_info=True)
    name = os.path.basename(folder.rstrip("/")) if folder else fallback_name
    digest = hashlib.sha256(json.dumps([df.schema.json(), source, rows]).encode())
    return Dataset(name=name, digest=digest.hexdigest()[:8], source_type="spark",
                   source=json.dumps(source), schema=schema,
                   profile=json.dumps({"num_rows": rows}))


def log_datasets(run, train_df, train_rows: int, eval_df=None, eval_rows: int = 0) -> None:
    """Best effort: a dataset the tracking store refuses never fails the fit."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = [(train_df, train_rows, "train_df", "training")]
    if eval_df is not None:
        inputs.append((eval_df, eval_rows, "eval_df", "evaluation"))
    try:
        entities = [DatasetInput(dataset_entity(df, rows, name),
                                 tags=[InputTag(key="mlflow.data.context", value=context)])
                    for df, rows, name, context in inputs]
        run.log_inputs(entities)
    except Exception:  # noqa: BLE001 - the run goes on without its Datasets column
        log.warning("could not log the fit's datasets to MLflow", exc_info=True)
