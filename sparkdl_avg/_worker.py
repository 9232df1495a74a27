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
from dataclasses import dataclass, replace

import numpy as np

import sparkdl_avg
from sparkdl_avg import _wire
from sparkdl_avg._config import TrainConfig
from sparkdl_avg._plan import Schedule, batch_slice, epoch_order
from sparkdl_avg._ps_client import PSClient

REPORT_SCHEMA = (
    "partition int, host string, pid long, device string, gpu string, warning string, "
    "train_rows long, eval_rows long, load_s double, version string, library string"
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
    ps_address: tuple[str, int] | None = None
    """Async mode: the parameter server (then `address` is unused)."""
    ps_tls_ca_pem: str | None = None
    """PEM text of the CA that verifies the server (files on the driver are not on executors)."""

    @classmethod
    def for_plan(cls, plan, config: TrainConfig, *, classify: bool, secret: bytes,
                 connect_s: float, address: tuple[str, int] = ("", 0),
                 ps_address: tuple[str, int] | None = None,
                 ps_tls_ca_pem: str | None = None) -> WorkerSpec:
        """The spec for a fit's plan (`_fit._Plan`), in either mode."""
        import torch

        return cls(
            address=address, secret=secret, schedule=plan.schedule, connect_s=connect_s,
            train_rows=plan.data.train_sizes, eval_rows=plan.data.eval_sizes,
            # a callable optimizer travels by value in plan.pickled; Spark would pickle it
            # by reference, which fails for user modules the executors lack
            config=replace(config, optimizer="sgd") if callable(config.optimizer) else config,
            num_features=plan.data.num_features,
            double_precision=plan.dtype == torch.float64, long_labels=plan.long_labels,
            classify=classify, ps_address=ps_address, ps_tls_ca_pem=ps_tls_ca_pem,
            **plan.pickled,
        )


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
    if spec.ps_address is None:
        _train(spec, rank, data, device, hello)
    else:
        _train_async(spec, rank, data, device)
    report = {"partition": [rank], "host": [hello["host"]], "pid": [os.getpid()],
              "device": [choice.device], "gpu": [choice.gpu_address],
              "warning": [choice.warning], "train_rows": [hello["train_rows"]],
              "eval_rows": [hello["eval_rows"]], "load_s": [load_s],
              # which sparkdl-avg the executor runs (a --py-files zip, a packed environment)
              "version": [sparkdl_avg.__version__],
              "library": [os.path.dirname(sparkdl_avg.__file__)]}
    yield pa.RecordBatch.from_pydict(report, schema=_report_schema())


def _report_schema():
    import pyarrow as pa

    return pa.schema([("partition", pa.int32()), ("host", pa.string()), ("pid", pa.int64()),
                      ("device", pa.string()), ("gpu", pa.string()), ("warning", pa.string()),
                      ("train_rows", pa.int64()), ("eval_rows", pa.int64()),
                      ("load_s", pa.float64()), ("version", pa.string()),
                      ("library", pa.string())])


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


class _Replica:
    """The task's model, optimizer and data, and the local steps of the shared schedule."""

    def __init__(self, spec: WorkerSpec, rank: int, data, device) -> None:
        import cloudpickle
        import torch

        from sparkdl_avg._model import make_loss, model_dtype, wire_dtype

        cfg = spec.config
        torch.manual_seed(_step_seed(cfg.seed, rank, -1))
        self.model = cloudpickle.loads(spec.model_fn)().to(device)
        self.dtype = model_dtype(self.model)
        x_train, y_train, x_eval, y_eval = data
        x_train, x_eval = x_train.to(self.dtype), x_eval.to(self.dtype)
        if not spec.long_labels:
            y_train, y_eval = y_train.to(self.dtype), y_eval.to(self.dtype)
        self.train_data, self.eval_data = (x_train, y_train), (x_eval, y_eval)
        self.wire_dtype = wire_dtype(self.dtype)
        self.loss_fn, _ = make_loss(cloudpickle.loads(spec.loss))
        self._factory = cloudpickle.loads(spec.optimizer) if spec.optimizer else None
        self.optimizer = None
        self.spec, self.rank, self.device = spec, rank, device
        self.step, self._order = 0, None

    def start(self, step: int = 0) -> None:
        """After the initial parameters are in: build the optimizer, enter training mode, and
        take up the data at `step` (a restart continues where its checkpoint left off)."""
        from sparkdl_avg._model import make_optimizer

        self.model.train()
        self.optimizer = make_optimizer(self.spec.config, self.model.parameters(), self._factory)
        self.step, self._order = step, None

    def rewind(self, step: int) -> None:
        """Take up the data at `step` again (steps after it were lost with a server)."""
        self.step, self._order = step, None

    def run_steps(self, count: int) -> tuple[float, int]:
        """`count` local minibatch steps; returns (summed loss x batch size, samples)."""
        import torch

        cfg, schedule = self.spec.config, self.spec.schedule
        x, y = self.train_data
        n_rows = x.shape[0]
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        samples = 0
        # Random state (dropout & co.) is a function of the position, so a restart from a
        # checkpoint draws exactly what the uninterrupted run drew.
        torch.manual_seed(_step_seed(cfg.seed, self.rank, self.step))
        for _ in range(count):
            epoch, in_epoch = divmod(self.step, schedule.steps_per_epoch)
            if in_epoch == 0 or self._order is None:
                self._order = torch.from_numpy(epoch_order(
                    n_rows, epoch=epoch, worker=self.rank, seed=cfg.seed, shuffle=cfg.shuffle,
                )).to(self.device)
            idx = self._order[batch_slice(in_epoch, cfg.batch_size, n_rows)]
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(x[idx]), y[idx])
            loss.backward()
            self.optimizer.step()
            loss_sum += loss.detach().double() * idx.numel()
            samples += idx.numel()
            self.step += 1
        return float(loss_sum), samples

    def evaluate(self) -> dict:
        return _evaluate(self.model, *self.eval_data, self.loss_fn, self.spec.classify)


def _train(spec: WorkerSpec, rank: int, data, device, hello: dict) -> None:
    from sparkdl_avg import _optimizer_state as optimizer_state
    from sparkdl_avg._model import FlatBuffer, averaged_tensors, optimizer_state_tensors

    cfg, schedule = spec.config, spec.schedule
    # Build the replica before connecting, so the driver's first round starts once all are
    # ready; a failure here is reported once connected, like any other.
    setup_error = None
    try:
        replica = _Replica(spec, rank, data, device)
        model, wire_dtype = replica.model, replica.wire_dtype
        flat = FlatBuffer(averaged_tensors(model), wire_dtype)
    except Exception as exc:
        setup_error = exc
    conn = _wire.connect(spec.address, timeout=cfg.round_timeout, max_payload=1 << 20)
    try:
        conn.authenticate_to_server(spec.secret, hello)
        if setup_error is not None:
            raise setup_error
        conn.set_timeout(spec.connect_s)  # the first parameters come once every worker is here
        first = conn.expect(_wire.Kind.AVERAGE, into=flat.array)
        ready = time.perf_counter()  # from here to a round's first step: setup (the picture)
        # The driver times out a hung worker after round_timeout and names it; the others,
        # waiting on that worker's average, must not time out first and take the blame.
        conn.set_timeout(2 * cfg.round_timeout + 30)
        flat.scatter()
        start_round = int(first.meta.get("round", -1)) + 1
        replica.start(step=start_round * schedule.averaging_frequency)
        # optimizer state (at checkpoints, and on restart) may be up to 3x the parameters
        conn.max_payload = 4 * flat.array.nbytes + (1 << 20)
        if first.meta.get("state"):
            frame = conn.expect(_wire.Kind.STATE)
            optimizer_state.restore(replica.optimizer, model, frame.meta.get("layout", []),
                                    frame.payload)
        state: list = []
        for round_index in range(start_round, schedule.num_rounds):
            t0 = time.perf_counter()
            setup_s = t0 - ready
            loss_sum, samples = replica.run_steps(schedule.steps_in_round(round_index))
            compute_s = time.perf_counter() - t0
            if cfg.average_optimizer_state:
                # Optimizer state appears lazily (after a parameter's first step): re-home it
                # into the wire buffer whenever the set of state tensors changes.
                current = optimizer_state_tensors(replica.optimizer, replica.dtype)
                if [id(t) for t in current] != [id(t) for t in state]:
                    state = current
                    flat = FlatBuffer(averaged_tensors(model) + state, wire_dtype)
            meta = {"round": round_index, "samples": samples, "loss_sum": loss_sum,
                    "compute_s": compute_s, "setup_s": setup_s, "numel": int(flat.array.size)}
            conn.send(_wire.Kind.PUSH, meta, flat.gather())
            reply = conn.expect(_wire.Kind.AVERAGE, into=flat.array)
            flat.scatter()
            if reply.meta.get("checkpoint"):
                layout, payload = optimizer_state.pack(replica.optimizer, model)
                conn.send(_wire.Kind.STATE, {"round": round_index, "layout": layout}, payload)
            if reply.meta.get("eval"):
                t_eval = time.perf_counter()
                stats = replica.evaluate()
                conn.send(_wire.Kind.EVAL, {**stats, "eval_s": time.perf_counter() - t_eval})
            ready = time.perf_counter()
        conn.send(_wire.Kind.DONE, {"steps": replica.step})
    except BaseException as exc:
        from sparkdl_avg._errors import SparkdlAvgError

        try:
            message = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            # our own checks fail the same way every time: restarting would not help
            conn.send(_wire.Kind.ERROR, {"rank": rank, "message": message[:4000],
                                         "fatal": isinstance(exc, SparkdlAvgError)})
        except OSError:
            pass
        raise
    finally:
        conn.close()


def _train_async(spec: WorkerSpec, rank: int, data, device) -> None:
    """Downpour: push the accumulated update every `push_every` steps, fetch the server's
    parameters every `fetch_every` steps (a multiple of push_every). The server records how
    many of this worker's steps it has applied; a worker (re)starting or reconnecting after
    the server restarted takes up the data from there, so no step is lost or counted twice."""
    from sparkdl_avg._model import FlatBuffer, averaged_tensors

    cfg, total = spec.config, spec.schedule.total_steps
    replica = _Replica(spec, rank, data, device)
    flat = FlatBuffer(averaged_tensors(replica.model), replica.wire_dtype)
    link = _ServerLink(spec, rank, flat)
    try:
        link.pull()
        replica.start(step=link.ps.progress)
        fetch_every = (cfg.fetch_every or cfg.push_every) // cfg.push_every
        pushes = 0
        while replica.step < total:
            loss_sum, samples = replica.run_steps(min(cfg.push_every, total - replica.step))
            try:
                current = flat.gather()
                link.ps.push(link.anchor - current, samples=samples, loss_sum=loss_sum,
                             steps=replica.step)
                np.copyto(link.anchor, current)
                pushes += 1
                if pushes % fetch_every == 0 or replica.step >= total:
                    link.pull()
            except OSError as exc:  # ProtocolError is one too: only a lost server may retry
                if not _wire.peer_gone(exc):
                    raise
                link.reconnect(exc)
                link.pull()
                replica.rewind(link.ps.progress)  # redo the steps the server lost
    finally:
        link.close()


class _ServerLink:
    """A worker's connection to the parameter server that outlives the server: when the
    connection breaks it reconnects (for up to round_timeout) to the same address, where a
    restarted server takes up its checkpoint."""

    def __init__(self, spec: WorkerSpec, rank: int, flat) -> None:
        self.spec, self.rank, self.flat = spec, rank, flat
        self.anchor = flat.array.copy()  # the parameters the next update is measured from
        self.ps = None
        self.reconnect(None)  # a server being restarted may not be back yet

    def _connect(self) -> PSClient:
        cfg = self.spec.config
        return PSClient(self.spec.ps_address, secret=self.spec.secret, worker=self.rank,
                        numel=self.flat.array.size, dtype=self.flat.array.dtype,
                        timeout=max(cfg.round_timeout, self.spec.connect_s),
                        tls_ca_pem=self.spec.ps_tls_ca_pem)

    def pull(self) -> None:
        """The server's parameters into the model (and `ps.progress`)."""
        self.ps.pull()
        np.copyto(self.flat.array, self.ps.params)
        self.flat.scatter()
        np.copyto(self.anchor, self.flat.array)

    def reconnect(self, cause: BaseException | None) -> None:
        """Connect, retrying for up to round_timeout while the server is away."""
        deadline = time.monotonic() + self.spec.config.round_timeout
        if self.ps is not None:
            self.ps.close()
        while True:
            try:
                self.ps = self._connect()
                return
            except OSError as exc:
                if not _wire.peer_gone(exc) or time.monotonic() > deadline:
                    lost = f"lost the parameter server ({cause}) and " if cause else ""
                    raise ConnectionError(
                        f"{lost}could not connect to it within round_timeout="
                        f"{self.spec.config.round_timeout:g}s: {exc}") from exc
                time.sleep(0.5)

    def close(self) -> None:
        if self.ps is not None:
            self.ps.close()


def _step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of worker `rank` from local step `step` on (-1: building the model)."""
    return int(np.random.SeedSequence([seed, rank, step + 1]).generate_state(1, np.uint64)[0]
               >> 1)


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
