"""Cluster checks before a fit starts (or restarts): slots, GPU settings, dynamic allocation,
and the addresses the driver listens on and advertises."""

from __future__ import annotations

import time

from pyspark.sql import SparkSession

from sparkdl_avg._errors import ClusterError
from sparkdl_avg.task.device import check_gpu_scheduling

SLOT_WAIT_S = 10.0
"""How long a fit waits for executors still registering."""


def driver_addresses(spark: SparkSession) -> tuple[str, str]:
    """(bind, advertise): the coordinator listens where the driver binds and tells the executors
    the host they already reach the driver at (they differ in containers: 0.0.0.0 vs a name)."""
    conf = spark.sparkContext.getConf()
    advertise = conf.get("spark.driver.host", "127.0.0.1")
    return conf.get("spark.driver.bindAddress", None) or advertise, advertise


def check_cluster(spark: SparkSession, num_workers: int, device: str,
                  wait_s: float = SLOT_WAIT_S) -> int:
    """Fail in seconds, with the numbers, where Spark would retry for minutes or hang. Waits
    up to `wait_s` for executors still registering (or replacing a lost one)."""
    sc = spark.sparkContext
    conf = sc.getConf()
    gpu_amount = float(conf.get("spark.task.resource.gpu.amount", "0"))
    profile = training_profile(spark, device)
    check_gpu_scheduling(sc.master, 1.0 if profile is not None else gpu_amount, device)
    if conf.get("spark.dynamicAllocation.enabled", "false").lower() == "true":
        raise ClusterError("spark.dynamicAllocation.enabled=true: the training tasks run as one "
                           "barrier stage, which Spark refuses under dynamic allocation; "
                           "disable it for training")
    deadline = time.monotonic() + wait_s
    while True:
        slots = _concurrent_slots(spark, profile)
        if slots >= num_workers or time.monotonic() > deadline:
            break
        time.sleep(0.5)  # executors of a just-started cluster are still registering
    if slots < num_workers:
        cpus = conf.get("spark.task.cpus", "1")
        raise ClusterError(
            f"num_workers={num_workers} but the cluster runs only {slots} tasks at once "
            f"(master {sc.master}, spark.task.cpus={cpus}, "
            f"GPUs a task {1 if profile is not None else gpu_amount:g}); all workers must run "
            f"together, so lower num_workers to {max(slots, 1)} or add executors/cores"
        )
    return slots


def training_profile(spark: SparkSession, device: str):
    """A stage-level resource profile giving each training task one GPU, where executors
    have GPUs but tasks in general are not given any (`spark.task.resource.gpu.amount`
    unset): the GPUs then go to the training stage only, not to the validation and shuffle
    stages before it. None where the session's own settings already decide."""
    conf = spark.sparkContext.getConf()
    if device == "cpu" or float(conf.get("spark.task.resource.gpu.amount", "0")) > 0 \
            or float(conf.get("spark.executor.resource.gpu.amount", "0")) <= 0:
        return None
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(int(conf.get("spark.task.cpus", "1"))) \
        .resource("gpu", 1.0)
    return ResourceProfileBuilder().require(requests).build


def _concurrent_slots(spark: SparkSession, profile=None) -> int:
    jsc = spark.sparkContext._jsc.sc()
    manager = jsc.resourceProfileManager()
    if profile is None:
        return int(jsc.maxNumConcurrentTasks(manager.defaultResourceProfile()))
    manager.addResourceProfile(profile._java_resource_profile)  # known before its stage runs
    return int(jsc.maxNumConcurrentTasks(profile._java_resource_profile))
