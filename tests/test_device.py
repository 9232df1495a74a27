import pytest
import torch

from sparkdl_avg import ClusterError
from sparkdl_avg.task.device import (
    VisibleGpus,
    check_gpu_scheduling,
    choose_device,
    cuda_index,
    shared_gpus,
)

U = ["GPU-aaaa", "GPU-bbbb", "GPU-cccc", "GPU-dddd"]
"""A host's four GPUs, by physical id (NVML's numbering)."""


def _gpus(visible: str | None, nvml: bool = True) -> VisibleGpus:
    """What torch would see under CUDA_VISIBLE_DEVICES=`visible` (ids or UUIDs), with or
    without NVML's numbering of the host's GPUs."""
    shown = [U[int(d)] if d.isdigit() else d for d in visible.split(",")] if visible else U
    return VisibleGpus([u[4:] for u in shown],  # torch writes UUIDs without "GPU-"
                       dict(enumerate(U)) if nvml else None)


@pytest.mark.parametrize("nvml", [True, False])
def test_a_gpu_number_is_the_physical_id_whatever_cuda_visible_devices_says(nvml):
    assert cuda_index("3", None, _gpus(None, nvml)) == 3
    assert cuda_index("0", "", _gpus("", nvml)) == 0
    assert cuda_index("3", "2,3", _gpus("2,3", nvml)) == 1
    assert cuda_index("2", "2,3", _gpus("2,3", nvml)) == 0


def test_with_nvml_a_gpu_number_is_found_under_uuid_visible_devices():
    assert cuda_index("2", "GPU-dddd,GPU-cccc", _gpus("GPU-dddd,GPU-cccc")) == 1
    with pytest.raises(ClusterError, match="install nvidia-ml-py"):
        cuda_index("2", "GPU-dddd,GPU-cccc", _gpus("GPU-dddd,GPU-cccc", nvml=False))


@pytest.mark.parametrize("visible", [None, "1,2", "GPU-cccc,GPU-bbbb"])
def test_a_uuid_address_is_the_device_with_that_uuid(visible):
    gpus = _gpus(visible)
    assert cuda_index("GPU-bbbb", visible, gpus) == gpus.uuids.index("bbbb")
    assert cuda_index("gpu-BBBB", visible, gpus) == gpus.uuids.index("bbbb")
    with pytest.raises(ClusterError, match="does not show"):
        cuda_index("GPU-eeee", visible, gpus)


MIG = ["MIG-0a00", "MIG-0b00", "MIG-2a00"]
"""MIG devices of the host's GPUs 0 (two) and 2 (one), in `nvidia-smi -L`'s order."""


def _mig_gpus(visible: list[str]) -> VisibleGpus:
    """What torch sees when CUDA_VISIBLE_DEVICES names MIG devices (or all, unset)."""
    return VisibleGpus([u[4:] for u in visible], dict(enumerate(U)), MIG)


def test_a_mig_device_is_found_by_its_uuid():
    """MIG devices' UUIDs start "MIG-": only "GPU-" was stripped, so none was ever found."""
    gpus = VisibleGpus(["2a00", "0b00"], dict(enumerate(U)))
    assert cuda_index("MIG-0b00", "MIG-2a00,MIG-0b00", gpus) == 1
    choice = choose_device("auto", ["mig-2A00"], cuda_visible_devices="MIG-2a00,MIG-0b00",
                           cuda_available=True, gpus=gpus)
    assert (choice.device, choice.uuid) == ("cuda:0", "2a00")


def test_a_mig_device_by_number_counts_mig_devices_not_their_parent_gpu():
    """A discovery script on a split GPU numbers its MIG devices; NVML's number 2 is the
    parent GPU 2, which CUDA does not show (the old rule refused every such address)."""
    assert [cuda_index(a, None, _mig_gpus(MIG)) for a in "012"] == [0, 1, 2]
    assert cuda_index("2", "MIG-2a00,MIG-0a00", _mig_gpus(["MIG-2a00", "MIG-0a00"])) == 0
    with pytest.raises(ClusterError, match="MIG device 1, but CUDA_VISIBLE_DEVICES"):
        cuda_index("1", "MIG-2a00", _mig_gpus(["MIG-2a00"]))
    with pytest.raises(ClusterError, match="this host has 3 MIG devices"):
        cuda_index("3", None, _mig_gpus(MIG))
    # whole GPUs on a host where some other GPU is split: numbered as GPUs
    assert cuda_index("1", "1", VisibleGpus(["bbbb"], dict(enumerate(U)), MIG)) == 0


@pytest.mark.parametrize("nvml", [True, False])
def test_an_address_this_executor_cannot_see_is_refused_never_guessed(nvml):
    """The old rule took "0" under CUDA_VISIBLE_DEVICES=1,2 as an index: GPU 1 for the task
    given GPU 0, and GPU 1 again for the task given GPU 1."""
    with pytest.raises(ClusterError, match="hides it"):
        cuda_index("0", "1,2", _gpus("1,2", nvml))
    with pytest.raises(ClusterError, match="shows 4 device|has GPUs"):
        cuda_index("7", None, _gpus(None, nvml))
    with pytest.raises(ClusterError, match="neither a GPU number nor a UUID"):
        cuda_index("gpu0", None, _gpus(None, nvml))


def test_two_tasks_on_one_host_never_share_a_gpu():
    # Spark gave tasks 0 and 1 addresses "0" and "1"; CUDA_VISIBLE_DEVICES=1,2 on the host
    given = [choose_device("auto", [a], cuda_visible_devices="0,1", cuda_available=True,
                           gpus=_gpus("0,1")) for a in ("0", "1")]
    assert [c.device for c in given] == ["cuda:0", "cuda:1"]
    assert shared_gpus([(r, "h", c.uuid) for r, c in enumerate(given)]) is None
    clash = shared_gpus([(0, "h1", "aaaa"), (1, "h1", None), (2, "h1", "aaaa"),
                         (3, "h2", "bbbb")])
    assert clash.startswith("tasks 0 and 2 on host h1 were both given GPU aaaa")
    assert shared_gpus([(0, "h1", "aaaa"), (1, "h2", "bbbb")]) is None


def test_one_gpu_seen_from_two_containers_is_shared_whatever_their_host_names():
    """UUIDs are unique: two containers on one node, each with its own host name, given the
    same GPU share it (the old check, keyed by host and UUID, let them)."""
    clash = shared_gpus([(0, "container-a", "aaaa"), (1, "container-b", "aaaa")])
    assert clash.startswith("tasks 0 and 1 on hosts container-a and container-b were both "
                            "given GPU aaaa")


def test_extra_gpus_given_to_a_task_are_named():
    choice = choose_device("auto", ["0", "1"], cuda_visible_devices=None, cuda_available=True,
                           gpus=_gpus(None))
    assert choice.device == "cuda:0" and "gpu.amount=1" in choice.warning
    assert choice.uuid == "aaaa"


def test_auto_uses_the_assigned_gpu_when_cuda_works():
    choice = choose_device("auto", ["1"], cuda_visible_devices=None, cuda_available=True)
    assert (choice.device, choice.gpu_address, choice.warning) == ("cuda:1", "1", None)


def test_auto_falls_back_to_cpu_with_a_warning_when_cuda_is_missing():
    choice = choose_device("auto", ["1"], cuda_visible_devices=None, cuda_available=False)
    assert choice.device == "cpu" and choice.gpu_address == "1"
    assert "CUDA is not available" in choice.warning


def test_no_gpu_assigned_means_cpu():
    assert choose_device("auto", [], cuda_visible_devices="0", cuda_available=True).device == "cpu"
    assert choose_device("cpu", ["0"], cuda_visible_devices=None, cuda_available=True) \
        .device == "cpu"


def test_cuda_demanded_but_unavailable_is_an_error():
    with pytest.raises(ClusterError, match="assigned this task no GPU"):
        choose_device("cuda", [], cuda_visible_devices=None, cuda_available=True)
    with pytest.raises(ClusterError, match="cannot use CUDA"):
        choose_device("cuda", ["0"], cuda_visible_devices=None, cuda_available=False)


def test_gpu_tasks_in_local_mode_are_refused_instead_of_hanging():
    with pytest.raises(ClusterError, match="local mode cannot schedule GPU tasks"):
        check_gpu_scheduling("local[2]", 1.0, "auto")
    check_gpu_scheduling("local-cluster[2,1,1024]", 1.0, "auto")
    check_gpu_scheduling("spark://host:7077", 1.0, "cuda")
    check_gpu_scheduling("local[2]", 0.0, "auto")


def test_device_cuda_without_gpu_scheduling_is_refused():
    with pytest.raises(ClusterError, match="spark.task.resource.gpu.amount=1"):
        check_gpu_scheduling("spark://host:7077", 0.0, "cuda")


class Peers:
    """A barrier context whose one other task says `theirs` in the all-gather; what this
    task said is kept in `gathered`."""

    gathered: list = []

    def __init__(self, theirs):
        self.theirs = theirs

    def allGather(self, mine):  # noqa: N802 - pyspark's name
        import json

        Peers.gathered.append(json.loads(mine))
        return [mine, json.dumps(self.theirs)]


def test_the_task_refuses_a_gpu_another_task_on_its_host_was_given(monkeypatch):
    """The barrier all-gather's plumbing: each task's (rank, host, UUID) in, ClusterError out."""
    import socket

    from sparkdl_avg.task import device
    from sparkdl_avg.task.device import DeviceChoice
    from sparkdl_avg.task.entry import _agree_on_devices

    host = socket.gethostname()
    mine = DeviceChoice("cuda:0", "0", None, "aaaa")
    monkeypatch.setattr(device, "task_device", lambda wanted: mine)
    with pytest.raises(ClusterError, match=f"tasks 0 and 1 on host {host} were both given"):
        _agree_on_devices(Peers([1, host, "aaaa", None, "cuda:0", None]), 0, "auto")
    assert _agree_on_devices(Peers([1, host, "bbbb", None, "cuda:1", None]), 0, "auto") is mine
    with pytest.raises(ClusterError, match=f"on hosts {host} and elsewhere"):
        _agree_on_devices(Peers([1, "elsewhere", "aaaa", None, "cuda:0", None]), 0, "auto")


def test_a_fit_with_some_tasks_on_the_cpu_and_others_on_gpus_is_refused(monkeypatch):
    """CUDA unusable on one host: that task fell back to the CPU while its peers took their
    GPUs, and the collective transport's group (gloo there, NCCL here) hung until its
    timeout on every restart. Every task now refuses the mix, naming the CPU's tasks."""
    from sparkdl_avg._errors import is_final
    from sparkdl_avg.task import device
    from sparkdl_avg.task.device import DeviceChoice, mixed_devices
    from sparkdl_avg.task.entry import _agree_on_devices

    fell_back = choose_device("auto", ["0"], cuda_visible_devices=None, cuda_available=False)
    assert fell_back.cpu_fallback.startswith("Spark assigned GPU 0 but CUDA is not available")
    on_gpu = DeviceChoice("cuda:0", "0", None, "aaaa")
    assert on_gpu.cpu_fallback is None and DeviceChoice("cpu", None).cpu_fallback is None

    monkeypatch.setattr(device, "task_device", lambda wanted: on_gpu)
    with pytest.raises(ClusterError, match=r"tasks 1 on h2 would train on the CPU while the "
                                           r"others train on GPUs \(Spark assigned GPU 0 but "
                                           "CUDA is not available") as info:
        _agree_on_devices(Peers([1, "h2", None, None, "cpu", fell_back.cpu_fallback]), 0,
                          "auto")
    assert is_final(info.value)
    monkeypatch.setattr(device, "task_device", lambda wanted: fell_back)
    with pytest.raises(ClusterError, match="tasks 0 on "):
        _agree_on_devices(Peers([1, "h2", "bbbb", None, "cuda:0", None]), 0, "auto")
    # all on the CPU is one kind: trained, and reported as each task loads
    assert _agree_on_devices(Peers([1, "h2", None, None, "cpu", "no CUDA"]), 0, "auto") \
        is fell_back
    assert mixed_devices([(0, "h", "cuda:0", None), (1, "h", "cuda:1", None)]) is None


def test_a_cpu_fallback_reaches_the_driver_while_the_task_loads(monkeypatch):
    """Not only in the report row at the end of the fit: the load monitor hears it with the
    task's first load report, and the driver logs it and tags the run."""
    import time

    from sparkdl_avg.driver import barrier
    from sparkdl_avg.driver.load_monitor import LoadMonitor
    from sparkdl_avg.task.load_report import LoadReporter

    class Run:
        tags: dict = {}

        def set_tags(self, tags):
            self.tags.update(tags)

    run, logged = Run(), []
    monkeypatch.setattr(barrier.log, "warning",
                        lambda fmt, *args: logged.append(fmt % args))
    with LoadMonitor(host="127.0.0.1", advertise="127.0.0.1", num_workers=2,
                     on_cpu_fallback=lambda rank, why: barrier.report_cpu_fallback(
                         run, rank, why)) as monitor:
        LoadReporter(monitor.reachable_at, monitor.secret, rank=0, of=10)(0)
        reporter = LoadReporter(monitor.reachable_at, monitor.secret, rank=1, of=10,
                                cpu_fallback="Spark assigned GPU 1 but CUDA is not available")
        reporter(0)
        reporter(10, done=True)  # heard twice, reported once
        deadline = time.monotonic() + 5
        while monitor.progress()[2] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert logged == ["partition 1 trains on the CPU: Spark assigned GPU 1 but CUDA is not "
                      "available"]
    assert run.tags == {"sparkdl_avg.cpu_fallback.1": "Spark assigned GPU 1 but CUDA is not "
                                                      "available"}


def test_a_task_whose_device_check_fails_still_joins_the_gather(monkeypatch):
    """No task may be left waiting in the barrier's all-gather for a peer that already failed
    (Spark kills a waiting task's executor when the stage is cancelled): the failing task
    says why in the gather and raises its own error; its peers fail naming it."""
    from sparkdl_avg.task import device
    from sparkdl_avg.task.device import DeviceChoice
    from sparkdl_avg.task.entry import _agree_on_devices

    gathered = Peers.gathered
    gathered.clear()

    def hidden(wanted):
        raise ClusterError("Spark assigned GPU 0, but CUDA_VISIBLE_DEVICES='1,2' hides it")

    monkeypatch.setattr(device, "task_device", hidden)
    with pytest.raises(ClusterError, match="CUDA_VISIBLE_DEVICES='1,2' hides it"):
        _agree_on_devices(Peers([1, "h", "bbbb", None, "cuda:1", None]), 0, "auto")
    assert gathered[-1][2] is None and "hides it" in gathered[-1][3]

    monkeypatch.setattr(device, "task_device",
                        lambda wanted: DeviceChoice("cuda:0", "1", None, "bbbb"))
    with pytest.raises(ClusterError, match="partition 0 on h has no device to train on: "
                                           "ClusterError: Spark assigned GPU 0"):
        _agree_on_devices(Peers([0, "h", None, "ClusterError: Spark assigned GPU 0", None,
                                 None]), 1, "auto")
    assert gathered[-1] == [1, gathered[-1][1], "bbbb", None, "cuda:0", None]


def test_device_errors_before_training_are_final_not_retried():
    from sparkdl_avg._errors import is_final
    from sparkdl_avg.task.device import LOAD_HINT, final_on_device_errors

    with pytest.raises(ClusterError, match="load its partition onto cuda:1 .*data_cache='disk'") \
            as err, final_on_device_errors("load its partition onto", "cuda:1", "1",
                                           hint=LOAD_HINT):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert is_final(err.value)
    with pytest.raises(ClusterError, match="invalid device ordinal"), \
            final_on_device_errors("start on", "cuda:1", "1"):
        raise RuntimeError("CUDA error: invalid device ordinal")
    with pytest.raises(RuntimeError, match="unrelated"), \
            final_on_device_errors("start on", "cuda:1", "1"):
        raise RuntimeError("unrelated")
    with pytest.raises(ClusterError, match="^cuda:1: the replica needs"), \
            final_on_device_errors("start on", "cuda:1", "1"):  # ours pass as they are
        raise ClusterError("cuda:1: the replica needs at least 404 MiB more")
    with pytest.raises(RuntimeError, match="^CUDA error: the user's"), \
            final_on_device_errors("build its replica on", "cpu"):  # a CPU fit's: as it is
        raise RuntimeError("CUDA error: the user's model_fn called .cuda()")


class _Transport:
    """A sync worker's transport that only records how the worker failed."""

    def __init__(self):
        self.failed = None

    def open(self, hello):
        pass

    def fail(self, message, final):
        self.failed = (message, final)

    def close(self):
        pass


@pytest.mark.parametrize("where", ["model", "averaging buffer"])
def test_out_of_memory_building_the_replica_on_its_gpu_is_final(monkeypatch, where):
    """Out of device memory moving the model to the GPU, or building the flat buffer it is
    averaged in, repeats on every restart (each reloading the partition): a final error."""
    from types import SimpleNamespace

    from sparkdl_avg import TrainConfig
    from sparkdl_avg.averaging import flat_buffer
    from sparkdl_avg.task import replica
    from sparkdl_avg.task.sync_loop import train_sync

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")

    class Built:
        def __init__(self, *args):
            if where == "model":
                out_of_memory()
            self.model, self.wire_dtype = torch.nn.Linear(2, 1), torch.float32

        def close(self):
            pass

    monkeypatch.setattr(replica, "Replica", Built)
    if where == "averaging buffer":
        monkeypatch.setattr(flat_buffer, "FlatBuffer", out_of_memory)
    transport = _Transport()
    with pytest.raises(ClusterError, match="could not build its replica on cuda:0: out of "
                                           "device memory"):
        train_sync(SimpleNamespace(schedule=None), TrainConfig(), 0, None,
                   torch.device("cuda:0"), transport, hello=None)
    message, final = transport.failed
    assert final and "out of device memory" in message


def test_out_of_memory_building_the_async_averaging_buffer_is_final(monkeypatch):
    """The async loop builds its own flat buffer (the second device copy of the model that
    it pushes from): out of memory there is as final as in the sync loop."""
    from types import SimpleNamespace

    from sparkdl_avg import TrainConfig
    from sparkdl_avg.averaging import flat_buffer
    from sparkdl_avg.task import replica
    from sparkdl_avg.task.async_loop import train_async

    class Built:
        def __init__(self, *args):
            self.model, self.wire_dtype = torch.nn.Linear(2, 1), torch.float32

    def out_of_memory(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")

    monkeypatch.setattr(replica, "Replica", Built)
    monkeypatch.setattr(flat_buffer, "FlatBuffer", out_of_memory)
    with pytest.raises(ClusterError, match="could not build its replica on cuda:0: out of "
                                           "device memory"):
        train_async(SimpleNamespace(schedule=SimpleNamespace(total_steps=1)),
                    TrainConfig(mode="async"), 0, None, torch.device("cuda:0"), None)


def test_a_task_leaves_no_reference_cycle_or_cuda_cache_behind(monkeypatch):
    """Spark reuses the worker: what a task cached would outlive it."""
    import gc
    import weakref

    import numpy as np
    import torch

    from sparkdl_avg.task.memory import release_task_memory

    class Holder:
        pass

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("device"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: calls.append("pinned host"),
                        raising=False)
    gc.disable()
    try:
        for _ in range(2):  # a second task's cycle too: what the first left is frozen
            held = Holder()
            held.me, held.data = held, np.ones(1 << 20)  # a cycle holding 8 MB
            alive = weakref.ref(held)
            del held
            assert alive() is not None  # only the cycle collector frees it
            release_task_memory()
            assert alive() is None
            # what survived is skipped by later collections (torch's objects among it)
            assert gc.get_freeze_count() > 100_000
    finally:
        gc.unfreeze()
        gc.enable()
    assert calls == ["device", "pinned host"] * 2


def test_a_replica_that_cannot_fit_its_device_is_named_with_the_numbers():
    from sparkdl_avg.task.device import device_shortfall

    mib = 1 << 20
    # 100 MiB of parameters with Adam: gradients, 2 moments and the flat buffer = 400 MiB
    fits = dict(param_bytes=100 * mib, optimizer_slots=2, batch_bytes=mib)
    assert device_shortfall(**fits, free_bytes=404 * mib) is None
    problem = device_shortfall(**fits, free_bytes=300 * mib)
    assert "needs at least 404 MiB more" in problem and "300 MiB are free" in problem
    assert device_shortfall(param_bytes=100 * mib, optimizer_slots=0, batch_bytes=mib,
                            free_bytes=300 * mib) is None  # plain SGD needs 204 MiB


def test_a_device_is_recorded_by_its_kind_and_gpu_model(monkeypatch):
    import torch

    from sparkdl_avg.task.device import device_identity

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_name",
                        lambda d: asked.append(d) or "NVIDIA H100 80GB HBM3")
    assert device_identity(torch.device("cpu")) == "cpu"
    assert device_identity(torch.device("cuda:1")) == "cuda/NVIDIA H100 80GB HBM3"
    assert asked == [torch.device("cuda:1")]  # the task's own GPU, not the current one


class _StaysPut(torch.nn.Linear):
    """A model that a fake GPU can take: moving it is a no-op."""

    def to(self, *args, **kwargs):
        return self


def test_scoring_on_a_gpu_hands_cudas_cache_back_for_the_next_task(monkeypatch):
    """Spark reuses the scoring task's Python worker: a cache still holding the model's
    blocks would fail a later fit's free-memory check on that GPU."""
    import gc

    import pyspark.sql.functions

    from sparkdl_avg.scoring.columns import vector_schema
    from sparkdl_avg.scoring.udf import make_predict_udf
    from sparkdl_avg.task import device
    from sparkdl_avg.task.device import DeviceChoice

    monkeypatch.setattr(pyspark.sql.functions, "arrow_udf", lambda fn, return_type: fn)
    predict = make_predict_udf(_StaysPut(3, 2), schema=vector_schema("x", 3, "float32"),
                               heads=("class",), device="cuda")
    calls = []
    monkeypatch.setattr(device, "task_device", lambda wanted: DeviceChoice("cuda:0", "0"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append("set_device"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
    try:
        assert list(predict(iter([]))) == []
    finally:
        gc.unfreeze()
    assert calls == ["set_device", "empty_cache"]


def test_nvmls_mig_devices_are_listed_by_gpu_then_by_slot(monkeypatch):
    """`visible_gpus` over a fake NVML: GPU 0 whole, GPU 1 split into MIG devices in slots
    0 and 2 (slot 1 empty), GPU 2 without MIG support."""
    import sys
    from types import SimpleNamespace

    from sparkdl_avg.task.device import visible_gpus

    class NVMLError(Exception):
        pass

    def mig_mode(handle):
        if handle == 2:
            raise NVMLError("not supported")
        return [int(handle == 1), 0]

    def mig_handle(handle, slot):
        if slot == 1:
            raise NVMLError("not found")
        return f"MIG-{handle}{slot}"

    fake = SimpleNamespace(
        NVMLError=NVMLError, NVML_DEVICE_MIG_ENABLE=1, nvmlInit=lambda: None,
        nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 3,
        nvmlDeviceGetHandleByIndex=lambda i: i, nvmlDeviceGetMigMode=mig_mode,
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 3,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_handle,
        nvmlDeviceGetUUID=lambda h: (h if isinstance(h, str) else f"GPU-{h}").encode())
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: SimpleNamespace(uuid="12"))
    gpus = visible_gpus()
    assert gpus == VisibleGpus(["12"], {0: "GPU-0", 1: "GPU-1", 2: "GPU-2"},
                               ["MIG-10", "MIG-12"])
    assert cuda_index("1", None, gpus) == 0


class _TooBigForItsGpu(torch.nn.Linear):
    def to(self, *args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 8 GiB")


def test_out_of_memory_moving_the_model_is_final_in_either_mode():
    """The replica (which both the sync and the async loop build) says so itself."""
    from types import SimpleNamespace

    import cloudpickle

    from sparkdl_avg import TrainConfig
    from sparkdl_avg._errors import is_final
    from sparkdl_avg.task.replica import Replica

    spec = SimpleNamespace(model_fn=cloudpickle.dumps(lambda: _TooBigForItsGpu(2, 1)), frozen=None)
    with pytest.raises(ClusterError, match="could not move the model to cuda:0: out of device "
                                           "memory") as info:
        Replica(spec, TrainConfig(), 0, None, torch.device("cuda:0"))
    assert is_final(info.value)
