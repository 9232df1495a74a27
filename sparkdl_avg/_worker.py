"""The Spark task: one replica trained on one partition, averaged through the driver.

Everything here runs on an executor. The task converts its partition to tensors once, on its
device, then follows the round schedule: k local steps, push parameters, receive the average.
"""

from __future__ import annotations

import os
import socket
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from sparkdl_avg._config import TrainConfig
from sparkdl_avg._plan import Schedule, batch_slice, epoch_order

REPORT_SCHEMA = (
    "partition int, host string, pid long, device string, gpu string, warning string, "
    "train_rows long, eval_rows long, load_s double"
)
_EVAL_CHUNK = 8192


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """Everything a task needs, as plain picklable values (no SparkSession, no sockets)."""

    address: tuple[str, int]
    secret: bytes
    model_fn: bytes
    loss: bytes
    config: TrainConfig
    schedule: Schedule
    num_features: int
    double_precision: bool
    long_labels: bool
    classify: bool
    connect_s: float
    """How long a worker waits for the others to load their partitions and connect."""
    train_rows: list[int]
    eval_rows: list[int]
    """Rows per partition as validation counted them; a task that gets others stops."""
    optimizer: bytes | None = None
    """A user optimizer factory, cloudpickled (config.optimizer is then a placeholder)."""


def run_task(spec: WorkerSpec, batches: Iterator) -> Iterator:
    """`mapInArrow` body: train, then yield one row describing this task."""
    import pyarrow as pa
    import torch
    from pyspark import BarrierTaskContext

    from sparkdl_avg._device import choose_device

    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    started = time.perf_counter()
    resources = ctx.resources()
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    choice = choose_device(
        spec.config.device, gpus,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        cuda_available=bool(gpus) and torch.cuda.is_available(),
    )
    device = torch.device(choice.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    data = _load_partition(batches, spec, device)
    load_s = time.perf_counter() - started
    got = (int(data[0].shape[0]), int(data[2].shape[0]))
    if got != (spec.train_rows[rank], spec.eval_rows[rank]):
        raise RuntimeError(
            f"partition {rank} received {got[0]} training and {got[1]} evaluation rows, but "
            f"validation counted {spec.train_rows[rank]} and {spec.eval_rows[rank]}: the "
            "DataFrame changed between validation and training (a nondeterministic source or "
            "a table being written?). Cache it or write it to storage before fit()."
        )
    hello = {"rank": rank, "train_rows": int(data[0].shape[0]), "eval_rows": int(data[2].shape[0]),
             "device": choice.device, "gpu": choice.gpu_address, "host": socket.gethostname()}
    _train(spec, rank, data, device, hello)
    report = {"partition": [rank], "host": [hello["host"]], "pid": [os.getpid()],
              "device": [choice.device], "gpu": [choice.gpu_address],
              "warning": [choice.warning], "train_rows": [hello["train_rows"]],
              "eval_rows": [hello["eval_rows"]], "load_s": [load_s]}
    yield pa.RecordBatch.from_pydict(report, schema=_report_schema())


def _report_schema():
    import pyarrow as pa

    return pa.schema([("partition", pa.int32()), ("host", pa.string()), ("pid", pa.int64()),
                      ("device", pa.string()), ("gpu", pa.string()), ("warning", pa.string()),
                      ("train_rows", pa.int64()), ("eval_rows", pa.int64()),
                      ("load_s", pa.float64())])


def _load_partition(batches: Iterator, spec: WorkerSpec, device):
    """Arrow batches -> (X_train, y_train, X_eval, y_eval) on `device`, once per task."""
    import torch

    from sparkdl_avg._data import TRAIN

    feats, labels, rows, splits = [], [], [], []
    for batch in batches:
        values = batch.column(0).flatten().to_numpy(zero_copy_only=False)
        feats.append(values.reshape(-1, spec.num_features))
        labels.append(batch.column(1).to_numpy(zero_copy_only=False))
        rows.append(batch.column(2).to_numpy(zero_copy_only=False))
        splits.append(batch.column(3).to_numpy(zero_copy_only=False))
    float_dtype = np.float64 if spec.double_precision else np.float32
    if not feats:
        empty = torch.empty(0, spec.num_features)
        return empty, torch.empty(0), empty, torch.empty(0)
    x, y = np.concatenate(feats), np.concatenate(labels)
    row, split = np.concatenate(rows), np.concatenate(splits)
    # Spark's shuffle delivers rows in no fixed order: sort by global row number for determinism.
    order = np.lexsort((row, split))
    n_train = int(np.count_nonzero(split == TRAIN))
    x = x[order].astype(float_dtype, copy=False)
    y = y[order].astype(np.int64 if spec.long_labels else float_dtype, copy=False)

    def to_device(a: np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(a))
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    out = (to_device(x[:n_train]), to_device(y[:n_train]), to_device(x[n_train:]),
           to_device(y[n_train:]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


def _train(spec: WorkerSpec, rank: int, data, device, hello: dict) -> None:
    import cloudpickle
    import torch

    from sparkdl_avg import _wire
    from sparkdl_avg._model import (
        FlatBuffer,
        averaged_tensors,
        make_loss,
        make_optimizer,
        model_dtype,
        optimizer_state_tensors,
    )

    cfg, schedule = spec.config, spec.schedule
    x_train, y_train, x_eval, y_eval = data
    conn = _wire.connect(spec.address, timeout=cfg.round_timeout, max_payload=1 << 20)
    try:
        conn.authenticate_to_server(spec.secret, hello)
        torch.manual_seed(cfg.seed * 100_003 + rank)  # dropout & co. differ per replica
        model = cloudpickle.loads(spec.model_fn)().to(device)
        dtype = model_dtype(model)
        x_train, x_eval = x_train.to(dtype), x_eval.to(dtype)
        if not spec.long_labels:
            y_train, y_eval = y_train.to(dtype), y_eval.to(dtype)
        wire_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        flat = FlatBuffer(averaged_tensors(model), wire_dtype)
        conn.set_timeout(spec.connect_s)  # the first parameters come once every worker is here
        conn.expect(_wire.Kind.AVERAGE, into=flat.array)
        conn.set_timeout(cfg.round_timeout)
        flat.scatter()
        model.train()
        factory = cloudpickle.loads(spec.optimizer) if spec.optimizer else None
        optimizer = make_optimizer(cfg, model.parameters(), factory)
        loss_fn, _ = make_loss(cloudpickle.loads(spec.loss))
        n_rows, order, step, state = x_train.shape[0], None, 0, []
        for round_index in range(schedule.num_rounds):
            t0 = time.perf_counter()
            loss_sum = torch.zeros((), dtype=torch.float64, device=device)
            samples = 0
            for _ in range(schedule.steps_in_round(round_index)):
                epoch, in_epoch = divmod(step, schedule.steps_per_epoch)
                if in_epoch == 0:
                    order = torch.from_numpy(epoch_order(
                        n_rows, epoch=epoch, worker=rank, seed=cfg.seed, shuffle=cfg.shuffle,
                    )).to(device)
                idx = order[batch_slice(in_epoch, cfg.batch_size, n_rows)]
                optimizer.zero_grad(set_to_none=True)
                loss = loss_fn(model(x_train[idx]), y_train[idx])
                loss.backward()
                optimizer.step()
                loss_sum += loss.detach().double() * idx.numel()
                samples += idx.numel()
                step += 1
            compute_s = time.perf_counter() - t0
            if cfg.average_optimizer_state:
                # Optimizer state appears lazily (after a parameter's first step): re-home it
                # into the wire buffer whenever the set of state tensors changes.
                current = optimizer_state_tensors(optimizer, dtype)
                if [id(t) for t in current] != [id(t) for t in state]:
                    state = current
                    flat = FlatBuffer(averaged_tensors(model) + state, wire_dtype)
            meta = {"round": round_index, "samples": samples, "loss_sum": float(loss_sum),
                    "compute_s": compute_s, "numel": int(flat.array.size)}
            conn.send(_wire.Kind.PUSH, meta, flat.gather())
            reply = conn.expect(_wire.Kind.AVERAGE, into=flat.array)
            flat.scatter()
            if reply.meta.get("eval"):
                t_eval = time.perf_counter()
                stats = _evaluate(model, x_eval, y_eval, loss_fn, spec.classify)
                conn.send(_wire.Kind.EVAL, {**stats, "eval_s": time.perf_counter() - t_eval})
        conn.send(_wire.Kind.DONE, {"steps": step})
    except BaseException as exc:
        try:
            message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            conn.send(_wire.Kind.ERROR, {"rank": rank, "message": message[:4000]})
        except OSError:
            pass
        raise
    finally:
        conn.close()


def _evaluate(model, x, y, loss_fn, classify: bool) -> dict:
    import torch

    loss_sum, correct = 0.0, 0
    was_training = model.training
    model.eval()
    with torch.no_grad():
        for start in range(0, x.shape[0], _EVAL_CHUNK):
            xb, yb = x[start:start + _EVAL_CHUNK], y[start:start + _EVAL_CHUNK]
            out = model(xb)
            loss_sum += float(loss_fn(out, yb)) * xb.shape[0]
            if classify:
                correct += int((out.argmax(dim=1) == yb).sum())
    model.train(was_training)
    return {"loss_sum": loss_sum, "correct": correct if classify else None,
            "count": int(x.shape[0])}
