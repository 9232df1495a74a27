"""Which device a task trains on, and the cluster checks that keep GPU runs from hanging.

Pure functions: the Spark task passes in what `TaskContext.resources()` and the environment
say, so the rules are tested without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from sparkdl_avg._errors import ClusterError

GPU_SETTINGS_HINT = (
    "set spark.executor.resource.gpu.amount (GPUs per executor), "
    "spark.task.resource.gpu.amount=1 (one GPU per training task) and a GPU discovery script "
    "(spark.executor.resource.gpu.discoveryScript)"
)


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: str
    """A torch device string: "cpu" or "cuda:<index>"."""
    gpu_address: str | None
    """The GPU address Spark assigned to the task, if any."""
    warning: str | None = None


def cuda_index(address: str, cuda_visible_devices: str | None) -> int:
    """The torch device index of a Spark GPU address.

    Spark's addresses are physical GPU ids from the discovery script. When the executor already
    restricts visible GPUs with CUDA_VISIBLE_DEVICES, torch numbers only those, so a physical id
    found in that list maps to its position there; an address that is not in the list is taken
    as an index into it (the convention of pyspark's TorchDistributor)."""
    if not address.isdigit():
        raise ClusterError(f"GPU address {address!r} is not a CUDA device number")
    if cuda_visible_devices is None or cuda_visible_devices.strip() == "":
        return int(address)
    visible = [d.strip() for d in cuda_visible_devices.split(",") if d.strip()]
    if address in visible:
        return visible.index(address)
    if int(address) < len(visible):
        return int(address)
    raise ClusterError(
        f"Spark assigned GPU {address}, but CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} hides "
        "it; make the discovery script report the GPUs the executor can see"
    )


def choose_device(
    preference: str,
    gpu_addresses: list[str],
    *,
    cuda_visible_devices: str | None,
    cuda_available: bool,
) -> DeviceChoice:
    if preference == "cpu":
        return DeviceChoice("cpu", None)
    if not gpu_addresses:
        if preference == "cuda":
            raise ClusterError(f"device='cuda' but Spark assigned this task no GPU: "
                               f"{GPU_SETTINGS_HINT}")
        return DeviceChoice("cpu", None)
    address = gpu_addresses[0]
    if not cuda_available:
        if preference == "cuda":
            raise ClusterError(f"Spark assigned GPU {address} but torch cannot use CUDA here "
                               "(a CPU-only torch build, or no driver)")
        return DeviceChoice("cpu", address, f"Spark assigned GPU {address} but CUDA is not "
                            "available to torch; this task trains on the CPU")
    return DeviceChoice(f"cuda:{cuda_index(address, cuda_visible_devices)}", address)


def check_gpu_scheduling(master: str, task_gpu_amount: float, device: str) -> None:
    """Refuse the configurations that would hang or silently ignore the user's GPUs."""
    local = master.startswith("local") and not master.startswith("local-cluster")
    if local and task_gpu_amount > 0:
        raise ClusterError(
            f"spark.task.resource.gpu.amount={task_gpu_amount:g} on master {master!r}: Spark's "
            "local mode cannot schedule GPU tasks and would wait forever. Unset it (the tasks "
            "then train on CPU) or use a cluster (standalone, YARN, Kubernetes, local-cluster)."
        )
    if device == "cuda" and task_gpu_amount <= 0:
        raise ClusterError(f"device='cuda' but tasks are not given GPUs: {GPU_SETTINGS_HINT}")


def task_device(preference: str) -> DeviceChoice:
    """The device of the running Spark task (training or scoring): the GPU Spark assigned it
    (`TaskContext.resources()`), under this executor's CUDA_VISIBLE_DEVICES, when torch can
    use CUDA; else the CPU."""
    import os

    import torch
    from pyspark import TaskContext

    ctx = TaskContext.get()
    resources = ctx.resources() if ctx is not None else {}
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    return choose_device(preference, gpus,
                         cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                         cuda_available=bool(gpus) and torch.cuda.is_available())
