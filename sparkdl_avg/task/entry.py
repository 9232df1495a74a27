"""The Spark task: one replica trained on one partition (`mapInArrow(barrier=True)` body).

It picks its device, claims its own worker key from the driver (`enrolment`), loads its
partition once into its data cache (memory, or spill files under Spark's local directories
that are removed on every path out), runs the sync or the async loop, and yields one report
row with what it used. An error a restart would only repeat (`_errors.is_final`) leaves the
task as a `FinalTaskError`, which the driver recognises and fails the fit on at once.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator

from sparkdl_avg.task.spec import WorkerSpec


def run_task(spec: WorkerSpec, batches: Iterator) -> Iterator:
    """Train, then yield one row describing this task (`report.FIELDS`)."""
    from sparkdl_avg.task.probe import warmed_up

    warmed_up()  # never import torch beside the probe's warm-up thread
    from sparkdl_avg._errors import FinalTaskError, is_final

    try:
        yield _run(spec, batches)
    except BaseException as exc:
        # a normal stage's failure reaches the driver as this traceback alone (on Connect
        # too, which has no status store): it names the partition for `driver.barrier`
        if hasattr(exc, "add_note"):  # Python 3.11+; on 3.10 a Connect job's names none
            exc.add_note(f"sparkdl-avg: the training task of partition {_partition_now()}")
        if is_final(exc):
            raise FinalTaskError(f"{type(exc).__name__}: {exc}") from exc
        raise
    finally:
        from sparkdl_avg.task.memory import release_task_memory

        release_task_memory()


def _run(spec: WorkerSpec, batches: Iterator):
    import cloudpickle
    import torch
    from pyspark import BarrierTaskContext, TaskContext

    from sparkdl_avg import _version
    from sparkdl_avg.data.partition import cache_kind, load_partition
    from sparkdl_avg.data.spill import SpillDir
    from sparkdl_avg.net import messages as msg
    from sparkdl_avg.task import memory
    from sparkdl_avg.task.device import (
        LOAD_HINT,
        device_identity,
        final_on_device_errors,
        set_deterministic,
        task_device,
    )
    from sparkdl_avg.task.enrolment import enrol
    from sparkdl_avg.task.load_report import LoadReporter
    from sparkdl_avg.task.report import record_batch

    config = cloudpickle.loads(spec.config)
    # an elastic fit's tasks and async tasks run as a normal stage, whose failed task Spark
    # retries alone
    normal_stage = config.mode == "async" or config.min_workers is not None
    ctx = TaskContext.get() if normal_stage else BarrierTaskContext.get()
    rank = ctx.partitionId()
    set_deterministic(config.deterministic)  # before CUDA starts: cuBLAS reads its setting
    # every task or none: the same spec reaches them all
    choice = _agree_on_devices(ctx, rank, config.device) if spec.gpu_tasks and not normal_stage \
        else task_device(config.device)
    device = torch.device(choice.device)
    if device.type == "cuda":
        with final_on_device_errors("start on", choice.device, choice.gpu_address):
            torch.cuda.set_device(device)
    torch.set_num_threads(max(1, ctx.cpus()))
    # after the device gather, where a task that leaves early would take its executor down;
    # before the load, so a refused claim fails the fit before minutes of loading
    # a normal stage orders a partition's attempts by Spark's task attempt id, unique in the
    # application (a stage Spark reruns numbers its attempts from 0 again)
    attempt = ctx.taskAttemptId() if normal_stage else ctx.attemptNumber()
    credential = enrol(spec.load_monitor, spec.load_secret, rank, attempt,
                       config.waits().connect)
    # without a reset the peak could be an earlier task's in this reused worker: none then
    own_peak = memory.reset_peak()
    start_rss = memory.resident_bytes()
    shape = spec.shape(rank)
    cache = cache_kind(config.data_cache, shape, config.cache_budget_mb)
    with contextlib.ExitStack() as cleanup:  # spill files go on every path out
        spill = cleanup.enter_context(SpillDir.create(shape.bytes, rank=rank)) \
            if cache == "disk" else None
        progress = LoadReporter(spec.load_monitor, spec.load_secret, rank,
                                shape.train_rows + shape.eval_rows, choice.cpu_fallback)
        with final_on_device_errors("load its partition onto", choice.device,
                                    choice.gpu_address, hint=LOAD_HINT):
            # with a preprocess the rows stay raw on the host: it decodes them per batch
            raw = spec.preprocess is not None
            data = load_partition(batches, shape, cache=cache, spill=spill,
                                  device=torch.device("cpu") if raw else device,
                                  dtype=None if raw else getattr(torch, spec.model_dtype),
                                  progress=progress)
        cleanup.callback(data.close)
        hello = msg.WorkerHello(rank=rank, host=socket.gethostname(),
                                device=device_identity(device), attempt=attempt)
        if config.mode == "sync":
            from sparkdl_avg.averaging.driver_channel import DriverChannel
            from sparkdl_avg.task.sync_loop import train_sync

            waits = config.waits()
            channel = DriverChannel(spec.address, credential,
                                    connect_timeout=waits.connect, reply_timeout=waits.reply,
                                    tls_ca_pem=spec.tls_ca_pem)
            if config.transport == "collective":
                from sparkdl_avg.averaging.collective import CollectiveChannel

                channel = CollectiveChannel(
                    channel, rank=rank, world=config.num_workers, device=device,
                    # as a worker's wait for the driver: past the driver's round watchdog,
                    # which names a hung worker before its peers time out and take the blame
                    all_gather=ctx.allGather, connect_timeout_s=waits.connect,
                    round_timeout_s=waits.reply)
            outcome = train_sync(spec, config, rank, data, device, channel, hello)
        else:
            from sparkdl_avg.task.async_loop import train_async

            outcome = train_async(spec, config, rank, data, device, credential, attempt)
        peak = memory.peak_resident_bytes() if own_peak else None
        train = data.train
        return record_batch({
            "partition": rank, "host": hello.host, "pid": os.getpid(),
            "device": choice.device, "gpu": choice.gpu_address,
            "warning": "; ".join(w for w in (choice.warning, *outcome["warnings"]) if w)
            or None, "pad_fraction": outcome["pad_fraction"],
            "pad_positions": outcome["pad_positions"],
            "ragged_positions": outcome["ragged_positions"],
            "train_rows": data.rows[0], "eval_rows": data.rows[1], "load_s": data.load_s,
            "version": _version.__version__, "library": os.path.dirname(_version.__file__),
            "cache": cache, "start_rss_mb": _mb(start_rss), "peak_rss_mb": _mb(peak),
            "spilled_mb": _mb(data.spilled_bytes),
            "load_mb_s": _mb(shape.bytes) / max(data.load_s, 1e-9),
            "read_mb_s": _mb(train.assembled_bytes) / train.assemble_s
            if train.assemble_s > 0 else None, "batch_wait_s": outcome["batch_wait_s"]})


def _agree_on_devices(ctx, rank: int, wanted: str):
    """This task's device, once every task has said which GPU it got, or why it has none (a
    barrier all-gather, before any data moves). Two tasks given one GPU, or some tasks on
    the CPU (CUDA unusable on their host) while others train on GPUs, stop the fit with a
    ClusterError naming them. A task whose device check fails still joins the
    gather, and every task then fails with its error: a task left waiting in the gather when
    the stage is cancelled takes its whole executor down (Spark's `barrierAndServe` lets the
    TaskKilledException escape to the executor's uncaught-exception handler, exit code 50),
    and the next fit would meet a dying executor."""
    import json

    from sparkdl_avg._errors import ClusterError
    from sparkdl_avg.task.device import mixed_devices, shared_gpus, task_device

    host = socket.gethostname()
    try:
        choice, own_error = task_device(wanted), None
        fallback = choice.cpu_fallback[:2000] if choice.cpu_fallback else None
        mine = json.dumps([rank, host, choice.uuid, None, choice.device, fallback])
    except Exception as exc:  # noqa: BLE001 - raised below, after the gather
        own_error = exc
        mine = json.dumps([rank, host, None, f"{type(exc).__name__}: {exc}"[:2000], None,
                           None])
    said = [json.loads(m) for m in ctx.allGather(mine)]
    if own_error is not None:
        raise own_error
    failed = [(r, h, error) for r, h, _, error, _, _ in said if error is not None]
    if failed:
        r, h, error = min(failed)
        raise ClusterError(f"partition {r} on {h} has no device to train on: {error}")
    problem = shared_gpus([(r, h, uuid) for r, h, uuid, *_ in said]) \
        or mixed_devices([(r, h, device, why) for r, h, _, _, device, why in said])
    if problem:
        raise ClusterError(problem)
    return choice


def _partition_now() -> int | None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return None if ctx is None else ctx.partitionId()


def _mb(n: int | None) -> float | None:
    return None if n is None else n / (1 << 20)
