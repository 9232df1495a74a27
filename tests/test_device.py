import pytest

from sparkdl_avg import ClusterError
from sparkdl_avg.task.device import check_gpu_scheduling, choose_device, cuda_index


def test_gpu_address_is_the_cuda_index_without_visible_devices():
    assert cuda_index("3", None) == 3
    assert cuda_index("0", "") == 0


def test_physical_id_in_cuda_visible_devices_maps_to_its_position():
    assert cuda_index("3", "2,3") == 1
    assert cuda_index("2", "2,3") == 0


def test_address_not_in_visible_devices_is_an_index_into_them():
    assert cuda_index("1", "4,5") == 1


def test_hidden_gpu_is_an_error():
    with pytest.raises(ClusterError, match="hides"):
        cuda_index("7", "4,5")
    with pytest.raises(ClusterError, match="not a CUDA device number"):
        cuda_index("gpu0", None)


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
