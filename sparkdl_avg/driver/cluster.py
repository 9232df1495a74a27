"""Cluster checks before a fit starts (or restarts): GPU settings, dynamic allocation, task
slots, and whether every executor reaches the address the driver's servers listen on; and
those addresses. The same code for a classic session and a Spark Connect one (`session`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sparkdl_avg._errors import ClusterError, DataCacheError
from sparkdl_avg.driver import session
from sparkdl_avg.task.device import check_gpu_scheduling, is_local_master

log = logging.getLogger("sparkdl_avg")
SLOT_WAIT_S = 10.0
"""How long a fit waits for executors still registering."""
PROBE_S = 30.0
"""How long the probe job may take beyond waiting for slots, where the session cannot say
how many slots there are (Spark Connect): past it, the job is taken as waiting for slots it
will never get. Where the slots are known to suffice, only the Python workers' start is
left to wait for, and that gets the fit's connect_timeout: a busy machine took over 40 s to
start them cold (torch imported under a load of 15 on 2 cores)."""


@dataclass(frozen=True, slots=True)
class DriverAddress:
    """Where this process's servers listen (`bind`, `port`; 0: any free port) and the host
    the executors are told to reach them at (`advertise`)."""

    bind: str
    advertise: str
    port: int = 0


def driver_address(spark, config) -> DriverAddress:
    """`config.driver_address` if given; else `spark.driver.host` on a classic session, and on
    Connect this process's address towards the Connect server (`session.client_address`).
    A classic session binds where Spark's driver binds (containers: 0.0.0.0 behind a name);
    a given or Connect address is bound as is where it is this machine's, else 0.0.0.0."""
    host, port = config.driver_host_port()
    if host is None and not session.is_connect(spark):
        advertise = session.conf(spark, "spark.driver.host", "127.0.0.1")
        bind = session.conf(spark, "spark.driver.bindAddress", None) or advertise
        return DriverAddress(bind, advertise, port)
    advertise = host or session.client_address(spark)
    return DriverAddress(advertise if _bindable_ip(advertise) else "0.0.0.0", advertise, port)


def _bindable_ip(host: str) -> bool:
    """An IP address of this machine. A host name is bound as 0.0.0.0: it may resolve here
    to an address others cannot reach (127.0.1.1 in many /etc/hosts)."""
    import ipaddress
    import socket

    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
        return True
    except (ValueError, OSError):
        return False


def check_cluster(spark, config, wait_s: float = SLOT_WAIT_S, *,
                  restart: bool = False) -> None:
    """Fail in seconds, with the numbers, where Spark would retry for minutes or hang, or the
    tasks would wait out their connect timeout: GPU settings, dynamic allocation, slots for
    `num_workers` tasks at once (waiting up to `wait_s` for executors still registering or
    replacing a lost one), then one probe job (`probe_cluster`). Before a `restart`, the
    probe runs only where the slots are not known otherwise (Connect), on a port of its own
    (the fit's servers hold theirs); nor does it run again where an earlier one found the
    same executors fit (`_probe_key`)."""
    num_workers, device = config.num_workers, config.device
    # an elastic fit starts with the slots it has, if at least min_workers (`elastic_start`)
    needed = config.min_workers if config.mode == "sync" and config.min_workers is not None \
        else num_workers
    master = session.conf(spark, "spark.master", "")
    profile, gpus = training_resources(spark, device)
    check_gpu_scheduling(master, gpus, device)
    if session.conf(spark, "spark.dynamicAllocation.enabled", "false").lower() == "true" \
            and needed == num_workers:
        raise ClusterError("spark.dynamicAllocation.enabled=true: the training tasks run as one "
                           "barrier stage, which Spark refuses under dynamic allocation; "
                           "disable it for training")
    # a local master has all its slots from the start: nothing to wait for
    deadline = time.monotonic() + (0 if is_local_master(master) else wait_s)
    while (slots := session.concurrent_slots(spark, profile)) is not None:
        if slots >= num_workers or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # executors of a just-started cluster are still registering
    if slots is not None and slots < needed:
        raise _too_few_slots(spark, needed, gpus, f"runs only {slots} tasks at once")
    if restart and slots is not None:
        return
    from sparkdl_avg.driver.probe import probe_cluster

    address = driver_address(spark, config)
    if restart:
        address = DriverAddress(address.bind, address.advertise)
    if slots is None:
        def too_late(s: float) -> ClusterError:
            return _too_few_slots(spark, num_workers, gpus,
                                  f"did not run {num_workers} tasks at once within {s:.0f}s")
    else:
        def too_late(s: float) -> ClusterError:
            return ClusterError(f"the probe job before training did not finish within "
                                f"{s:.0f}s, though the cluster has {slots} task slots: "
                                "are the executors' Python workers starting?")
    probed = _probe_key(spark, config, address, slots)
    if probed is not None and probed in _PROBED:
        return
    deadline_s = wait_s + PROBE_S if slots is None else \
        max(wait_s + PROBE_S, config.waits().connect)
    probe_cluster(spark, config, profile, address, deadline_s, too_few_slots=too_late,
                  tasks=needed if slots is None else max(needed, min(slots, num_workers)))
    if probed is not None:
        _PROBED.add(probed)


_PROBED: set[tuple] = set()
"""What probe jobs found fit: a later fit that asks the same of the same executors skips
its probe (a Spark job, 0.1-0.3 s of a warm fit), as a restart does."""


def _probe_key(spark, config, address: DriverAddress, slots: int | None) -> tuple | None:
    """What a probe's verdict depends on: the application and its executors, the slots, the
    address the servers listen on and the data cache. None where it must run every time: on
    Connect (executors cannot be listed there), or on a port the user gave (the probe is what
    finds it taken)."""
    executors = session.executors(spark)
    if executors is None or slots is None or address.port != 0:
        return None
    return (executors, slots, config.num_workers, config.device, address.bind,
            address.advertise, config.data_cache)


def _too_few_slots(spark, num_workers: int, gpus: float, what: str) -> ClusterError:
    cpus = session.conf(spark, "spark.task.cpus", "1")
    master = session.conf(spark, "spark.master", "?")
    return ClusterError(
        f"num_workers={num_workers} but the cluster {what} (master {master}, "
        f"spark.task.cpus={cpus}, GPUs a task {gpus:g}); all workers must run together, so "
        "lower num_workers or add executors/cores")


def training_resources(spark, device: str) -> tuple[object, float]:
    """The training stage's resource profile (`training_profile`) and the GPUs each training
    task is given: 1 under that profile, else `spark.task.resource.gpu.amount`."""
    profile = training_profile(spark, device)
    if profile is not None:
        return profile, 1.0
    return None, float(session.conf(spark, "spark.task.resource.gpu.amount", "0"))


def training_profile(spark, device: str):
    """A stage-level resource profile giving each training task one GPU, where executors
    have GPUs but tasks in general are not given any (`spark.task.resource.gpu.amount`
    unset): the GPUs then go to the training stage only, not to the validation and shuffle
    stages before it. None where the session's own settings already decide."""
    cpus = session.conf(spark, "spark.task.cpus", "1")
    if device == "cpu" or float(session.conf(spark, "spark.task.resource.gpu.amount", "0")) > 0 \
            or float(session.conf(spark, "spark.executor.resource.gpu.amount", "0")) <= 0:
        return None
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(int(cpus)).resource("gpu", 1.0)
    return ResourceProfileBuilder().require(requests).build


def check_local_dirs(problems: dict[str, str], data_cache: str) -> None:
    """A disk cache needs a usable local directory on every executor (`probe_cluster`)."""
    if problems and data_cache == "disk":
        where = "; ".join(f"{host}: {why}" for host, why in sorted(problems.items()))
        raise DataCacheError(f"data_cache='disk' but no local directory on these executors "
                             f"can hold spill files ({where}): point spark.local.dir "
                             "(SPARK_LOCAL_DIRS) at a writable disk")
    for host, why in problems.items():
        log.warning("executor on %s has no usable local directory (%s): a partition too big "
                    "for the memory cache would fail there", host, why)
