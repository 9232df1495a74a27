"""Which device a task trains on, and the cluster checks that keep GPU runs from hanging.

Pure functions: the Spark task passes in what `TaskContext.resources()` and the environment
say, so the rules are tested without a GPU.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from sparkdl_avg._errors import ClusterError, SparkdlAvgError

GPU_SETTINGS_HINT = (
    "set spark.executor.resource.gpu.amount (GPUs per executor) and a GPU discovery script "
    "(spark.executor.resource.gpu.discoveryScript); the fit then gives each training task one "
    "GPU through a stage-level resource profile (or set spark.task.resource.gpu.amount=1 to "
    "give every stage's tasks one)"
)


@dataclass(frozen=True, slots=True)
class DeviceChoice:
    device: str
    """A torch device string: "cpu" or "cuda:<index>"."""
    gpu_address: str | None
    """The GPU address Spark assigned to the task, if any."""
    warning: str | None = None
    uuid: str | None = None
    """The chosen GPU's UUID where CUDA reports it: two tasks must not share it."""

    @property
    def cpu_fallback(self) -> str | None:
        """Why the task trains on the CPU though Spark gave it a GPU; None if it does not."""
        return self.warning if self.device == "cpu" and self.gpu_address is not None \
            else None


@dataclass(frozen=True, slots=True)
class VisibleGpus:
    """What this process's CUDA shows (read in the task, injected in tests)."""

    uuids: list[str]
    """Each torch device's UUID, in torch's order."""
    physical: dict[int, str] | None = None
    """NVML's physical index -> UUID for every GPU on the host (None without NVML)."""
    mig: list[str] | None = None
    """NVML's MIG devices' UUIDs, in `nvidia-smi -L`'s order (by GPU, then by MIG device):
    how a discovery script numbers them on a host whose GPUs are split (None or empty: no
    MIG, or no NVML)."""


def _uuid(text: str) -> str:
    """A GPU's or MIG device's UUID as NVML ("GPU-8e5b...", "MIG-4f1c...") or torch
    ("8e5b...") writes it, compared lowercase without the prefix."""
    text = text.strip().lower()
    return text[4:] if text.startswith(("gpu-", "mig-")) else text


def _is_uuid(address: str) -> bool:
    return address.strip().lower().startswith(("gpu-", "mig-"))


def cuda_index(address: str, cuda_visible_devices: str | None,
               gpus: VisibleGpus | None = None) -> int:
    """The torch device index of a Spark GPU address, by one stated rule.

    A UUID address ("GPU-...") is the visible device with that UUID. A numeric address is a
    physical GPU id, as nvidia-smi and Spark's example discovery script number them (PCI bus
    order; the task sets CUDA_DEVICE_ORDER=PCI_BUS_ID so torch counts the same way): through
    NVML's UUID of that id where NVML is there, else its position in CUDA_VISIBLE_DEVICES
    when that lists ids, else the id itself. Where this process's devices are MIG devices (a
    split GPU), a numeric address counts MIG devices in `nvidia-smi -L`'s order instead,
    never their parent GPU. An address this process cannot see is a ClusterError, never a
    guess: guessing put two tasks on one GPU."""
    count = len(gpus.uuids) if gpus is not None else None
    visible_uuids = [_uuid(u) for u in gpus.uuids] if gpus is not None else []
    listed = [d.strip() for d in (cuda_visible_devices or "").split(",") if d.strip()]
    hint = ("make the discovery script report the GPUs this executor can see (or their "
            "UUIDs)")
    if _is_uuid(address):
        if _uuid(address) in visible_uuids:
            return visible_uuids.index(_uuid(address))
        raise ClusterError(f"Spark assigned GPU {address}, which this executor's CUDA does not "
                           f"show (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}); {hint}")
    if not address.isdigit():
        raise ClusterError(f"GPU address {address!r} is neither a GPU number nor a UUID")
    physical = int(address)
    migs = [_uuid(u) for u in (gpus.mig or [])] if gpus is not None else []
    if set(migs) & set(visible_uuids):
        if physical >= len(migs):
            raise ClusterError(f"Spark assigned GPU {address}, but this host has "
                               f"{len(migs)} MIG devices; {hint}")
        if migs[physical] not in visible_uuids:
            raise ClusterError(f"Spark assigned MIG device {address}, but CUDA_VISIBLE_DEVICES="
                               f"{cuda_visible_devices!r} hides it; {hint}")
        return visible_uuids.index(migs[physical])
    if gpus is not None and gpus.physical is not None:
        if physical not in gpus.physical:
            raise ClusterError(f"Spark assigned GPU {address}, but this host has GPUs "
                               f"{sorted(gpus.physical)} only; {hint}")
        uuid = _uuid(gpus.physical[physical])
        if uuid not in visible_uuids:
            raise ClusterError(f"Spark assigned GPU {address}, but CUDA_VISIBLE_DEVICES="
                               f"{cuda_visible_devices!r} hides it; {hint}")
        return visible_uuids.index(uuid)
    if not listed:
        index = physical
    elif all(d.isdigit() for d in listed):
        if address not in listed:
            raise ClusterError(f"Spark assigned GPU {address}, but CUDA_VISIBLE_DEVICES="
                               f"{cuda_visible_devices!r} hides it; {hint}")
        index = listed.index(address)
    else:
        raise ClusterError(f"Spark assigned GPU {address} by number, but CUDA_VISIBLE_DEVICES="
                           f"{cuda_visible_devices!r} lists UUIDs and NVML is not there to "
                           "tell which is which: install nvidia-ml-py on the executors, or "
                           "make the discovery script report UUIDs")
    if count is not None and index >= count:
        raise ClusterError(f"Spark assigned GPU {address}, but this executor's CUDA shows "
                           f"{count} device(s); {hint}")
    return index


def choose_device(
    preference: str,
    gpu_addresses: list[str],
    *,
    cuda_visible_devices: str | None,
    cuda_available: bool,
    gpus: VisibleGpus | None = None,
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
    index = cuda_index(address, cuda_visible_devices, gpus)
    warning = None
    if len(gpu_addresses) > 1:
        warning = (f"Spark assigned this task GPUs {gpu_addresses}; a replica trains on one "
                   f"({address}): set spark.task.resource.gpu.amount=1")
    uuid = _uuid(gpus.uuids[index]) if gpus is not None and index < len(gpus.uuids) else None
    return DeviceChoice(f"cuda:{index}", address, warning, uuid)


def shared_gpus(devices: list[tuple[int, str, str | None]]) -> str | None:
    """Given every task's (rank, host, GPU UUID), a message naming two tasks that were given
    the same GPU; None when no GPU is shared. Keyed by the UUID alone: UUIDs are unique
    across hosts, and two containers on one node may report different host names for one
    GPU."""
    owner: dict[str, tuple[int, str]] = {}
    for rank, host, uuid in devices:
        if uuid is None:
            continue
        other, other_host = owner.setdefault(uuid, (rank, host))
        if other != rank:
            where = f"on host {host}" if host == other_host else \
                f"on hosts {other_host} and {host}"
            return (f"tasks {other} and {rank} {where} were both given GPU {uuid}: one "
                    "GPU would train two replicas while another idles. Spark's GPU addresses "
                    "and the executor's CUDA_VISIBLE_DEVICES disagree (or two executors share "
                    "the GPU); make the discovery script report the GPUs (ids or UUIDs) this "
                    "executor's CUDA shows, and give each executor GPUs of its own")
    return None


def mixed_devices(devices: list[tuple[int, str, str, str | None]]) -> str | None:
    """Given every task's (rank, host, device, why it trains on the CPU), a message naming
    the tasks on the CPU when others train on GPUs; None when all train on one kind. A
    mixed fit would form a gloo group on some tasks and an NCCL one on others (the
    collective transport hangs until its timeout, on every restart) and trains at the pace
    of its slowest replica: refused, as a host's broken CUDA repeats on a restart."""
    on_cpu = [(r, h, why) for r, h, device, why in devices if device == "cpu"]
    if not on_cpu or len(on_cpu) == len(devices):
        return None
    named = ", ".join(f"{r} on {h}" for r, h, _ in sorted(on_cpu))
    why = next((why for _, _, why in sorted(on_cpu) if why), "no GPU")
    return (f"tasks {named} would train on the CPU while the others train on GPUs ({why}): "
            "every replica of a fit trains on one kind of device. Make CUDA usable on those "
            "executors (an NVIDIA driver, a CUDA build of torch), or train on the CPU with "
            "device='cpu'")


def is_local_master(master: str) -> bool:
    """`local`, `local[N]`: one process, all its slots there from the start, and no GPU
    scheduling (`local-cluster` has executors of its own)."""
    return master.startswith("local") and not master.startswith("local-cluster")


def check_gpu_scheduling(master: str, task_gpu_amount: float, device: str) -> None:
    """Refuse the configurations that would hang or silently ignore the user's GPUs."""
    if is_local_master(master) and task_gpu_amount > 0:
        raise ClusterError(
            f"spark.task.resource.gpu.amount={task_gpu_amount:g} on master {master!r}: Spark's "
            "local mode cannot schedule GPU tasks and would wait forever. Unset it (the tasks "
            "then train on CPU) or use a cluster (standalone, YARN, Kubernetes, local-cluster)."
        )
    if device == "cuda" and task_gpu_amount <= 0:
        raise ClusterError(f"device='cuda' but tasks are not given GPUs: {GPU_SETTINGS_HINT}")


def task_device(preference: str) -> DeviceChoice:
    """The device of the running Spark task (training or scoring): the GPU Spark assigned it
    (`TaskContext.resources()`), by `cuda_index`'s rule, when torch can use CUDA; else the
    CPU. Sets CUDA_DEVICE_ORDER=PCI_BUS_ID (unless set) before CUDA starts."""
    import os

    from pyspark import TaskContext

    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    import torch

    ctx = TaskContext.get()
    resources = ctx.resources() if ctx is not None else {}
    gpus = list(resources["gpu"].addresses) if "gpu" in resources else []
    available = bool(gpus) and torch.cuda.is_available()
    return choose_device(preference, gpus,
                         cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
                         cuda_available=available,
                         gpus=visible_gpus() if available else None)


def device_identity(device) -> str:
    """What a result's bits depend on, for checkpoints: "cpu", or "cuda/<GPU name>" (two GPUs
    of one model compute alike; another model, or the CPU, may round differently)."""
    if device.type != "cuda":
        return device.type
    import torch

    return f"cuda/{torch.cuda.get_device_name(device)}"


def visible_gpus() -> VisibleGpus:
    """torch's devices' UUIDs, and NVML's physical numbering where nvidia-ml-py is there."""
    import torch

    uuids = [str(torch.cuda.get_device_properties(i).uuid)
             for i in range(torch.cuda.device_count())]
    physical, mig = None, None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i)
                       for i in range(pynvml.nvmlDeviceGetCount())]
            physical = {i: _text(pynvml.nvmlDeviceGetUUID(h)) for i, h in enumerate(handles)}
            mig = [uuid for h in handles for uuid in _mig_uuids(pynvml, h)]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML: the CUDA_VISIBLE_DEVICES rule applies
        physical, mig = None, None
    return VisibleGpus(uuids, physical, mig)


def _mig_uuids(pynvml, handle) -> list[str]:
    """The UUIDs of a GPU's MIG devices, by MIG device index (none where MIG is off or not
    supported)."""
    try:
        if pynvml.nvmlDeviceGetMigMode(handle)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
            return []
        slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except pynvml.NVMLError:  # a GPU without MIG
        return []
    found = []
    for index in range(slots):
        try:
            found.append(_text(pynvml.nvmlDeviceGetUUID(
                pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index))))
        except pynvml.NVMLError:  # an empty slot
            continue
    return found


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def device_shortfall(*, param_bytes: int, optimizer_slots: int, batch_bytes: int,
                     free_bytes: int) -> str | None:
    """What a replica still needs on its device once its parameters are there, at least:
    for the `param_bytes` that train, gradients, optimizer state (`optimizer_slots` tensors a
    parameter) and the flat buffer they travel in; a few minibatches; a message if
    `free_bytes` is less (the
    activations come on top and are not counted)."""
    needed = param_bytes * (2 + optimizer_slots) + 4 * batch_bytes
    if needed <= free_bytes:
        return None
    mib = 1 << 20
    return (f"the replica needs at least {needed / mib:.0f} MiB more device memory "
            f"(gradients, optimizer state, the averaging buffer, minibatches), but "
            f"{free_bytes / mib:.0f} MiB are free: use a smaller model or batch_size, a GPU "
            "with more memory, or free this one (another process may hold it)")


LOAD_HINT = "spill the partition with data_cache='disk' or a smaller cache_budget_mb"
REPLICA_HINT = "use a smaller model, or a GPU with more free memory"


@contextlib.contextmanager
def final_on_device_errors(what: str, device: str, gpu: str | None = None, *,
                           hint: str = REPLICA_HINT):
    """A CUDA error before training (no such device; out of memory while loading the
    partition, moving the model or building the averaging buffer) would repeat on every
    restart: a ClusterError, which stops the fit at once. `what` the task could not do on
    `device` (Spark's GPU `gpu`); `hint` what to do about too little memory. On the CPU
    nothing is converted: an error there that names CUDA is the user's code's."""
    import torch

    if not device.startswith("cuda"):
        yield
        return
    where = f"{device} (GPU {gpu})" if gpu is not None else device
    try:
        yield
    except SparkdlAvgError:
        raise
    except torch.cuda.OutOfMemoryError as exc:
        raise ClusterError(f"the task could not {what} {where}: out of device memory ({exc}); "
                           f"{hint}") from exc
    except RuntimeError as exc:
        if "cuda" not in str(exc).lower():
            raise
        raise ClusterError(f"the task could not {what} {where}: {exc}") from exc


def set_deterministic(on: bool) -> None:
    """torch's deterministic mode for this task, on or off (Spark reuses the worker, so an
    earlier fit's choice must not leak into this one)."""
    import os

    import torch

    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)
    torch.backends.cudnn.deterministic = on
    if on:
        torch.backends.cudnn.benchmark = False
