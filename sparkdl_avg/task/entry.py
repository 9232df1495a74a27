"""The Spark task: one replica trained on one partition (`mapInArrow(barrier=True)` body).

It picks its device, converts its partition to tensors once, checks that it got the rows
validation counted, runs the sync or the async loop, and yields one report row. An error a
restart would only repeat (`_errors.is_final`) leaves the task as a `FinalTaskError`, which
the driver recognises and fails the fit on at once.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

from sparkdl_avg.task.spec import WorkerSpec


def run_task(spec: WorkerSpec, batches: Iterator) -> Iterator:
    """Train, then yield one row describing this task (`report.FIELDS`)."""
    from sparkdl_avg._errors import FinalTaskError, is_final

    try:
        yield _run(spec, batches)
    except BaseException as exc:
        if is_final(exc):
            raise FinalTaskError(f"{type(exc).__name__}: {exc}") from exc
        raise


def _run(spec: WorkerSpec, batches: Iterator):
    import cloudpickle
    import torch
    from pyspark import BarrierTaskContext

    from sparkdl_avg import _version
    from sparkdl_avg.data.partition import load_partition
    from sparkdl_avg.net import messages as msg
    from sparkdl_avg.task.device import task_device
    from sparkdl_avg.task.report import record_batch

    config = cloudpickle.loads(spec.config)
    ctx = BarrierTaskContext.get()
    rank = ctx.partitionId()
    started = time.perf_counter()
    choice = task_device(config.device)
    device = torch.device(choice.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    data = load_partition(batches, num_features=spec.num_features,
                          double_precision=spec.double_precision,
                          long_labels=spec.long_labels, device=device)
    load_s = time.perf_counter() - started
    _check_rows(rank, data.rows, (spec.train_rows[rank], spec.eval_rows[rank]))
    hello = msg.WorkerHello(rank=rank, host=socket.gethostname())
    if config.mode == "sync":
        from sparkdl_avg.averaging.driver_channel import DriverChannel
        from sparkdl_avg.task.sync_loop import train_sync

        waits = config.waits()
        channel = DriverChannel(spec.address, spec.secret, connect_timeout=waits.connect,
                                reply_timeout=waits.reply, tls_ca_pem=spec.tls_ca_pem)
        train_sync(spec, config, rank, data, device, channel, hello)
    else:
        from sparkdl_avg.task.async_loop import train_async

        train_async(spec, config, rank, data, device)
    return record_batch({
        "partition": rank, "host": hello.host, "pid": os.getpid(), "device": choice.device,
        "gpu": choice.gpu_address, "warning": choice.warning, "train_rows": data.rows[0],
        "eval_rows": data.rows[1], "load_s": load_s, "version": _version.__version__,
        "library": os.path.dirname(_version.__file__)})


def _check_rows(rank: int, got: tuple[int, int], counted: tuple[int, int]) -> None:
    from sparkdl_avg._errors import DataError

    if got != counted:
        raise DataError(
            f"partition {rank} received {got[0]} training and {got[1]} evaluation rows, but "
            f"validation counted {counted[0]} and {counted[1]}: the DataFrame changed between "
            "validation and training (a nondeterministic source or a table being written?). "
            "Cache it or write it to storage before fit().")
