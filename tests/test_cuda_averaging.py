"""Averaging between replicas that live on a GPU, without Spark: two replicas on the machine's
GPU 0 train real steps there and are averaged through the driver transport (the coordinator
on loopback, each replica's parameters re-homed into one flat CUDA tensor with a pinned host
copy), and the collective transport's pieces run on the device (the outer optimizer's state
on CUDA, an NCCL task group). Each claim is checked against an independent computation on the
CPU. Runs only where torch sees CUDA; docs/guide/gpus.md says where it last ran."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from sparkdl_avg import TrainConfig
from sparkdl_avg.averaging.coordinator import Coordinator
from sparkdl_avg.averaging.driver_channel import DriverChannel
from sparkdl_avg.averaging.flat_buffer import FlatBuffer
from sparkdl_avg.averaging.global_step import GlobalStep
from sparkdl_avg.averaging.outer import OuterOptimizer, outer_factory
from sparkdl_avg.averaging.process_group import TaskGroup
from sparkdl_avg.averaging.transport import RoundReport
from sparkdl_avg.net import messages as msg
from sparkdl_avg.net.auth import Credential, new_secret

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROWS = 16  # each replica's batch


def _model(dtype: torch.dtype, device: str) -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1)).to(dtype=dtype, device=device)


def _batches(workers: int, dtype: torch.dtype):
    rng = np.random.default_rng(7)
    x = torch.from_numpy(rng.standard_normal((workers * ROWS, 6))).to(dtype)
    y = torch.from_numpy(rng.standard_normal((workers * ROWS, 1))).to(dtype)
    return x, y


def _gpu_fit(rounds: int, dtype: torch.dtype, *, workers: int = 2, lr: float = 0.1,
             compression: str = "none", step: GlobalStep | None = None):
    """`workers` replicas on cuda:0, one SGD step a round on their own ROWS rows, averaged
    after every round by a loopback coordinator. Returns each replica's final parameters (on
    the CPU), the driver's final global parameters, and the first model's start."""
    secret = new_secret()
    x, y = _batches(workers, dtype)
    wire = np.float64 if dtype == torch.float64 else np.float32
    numel = sum(p.numel() for p in _model(dtype, "cpu").parameters())
    config = TrainConfig(delta_compression=compression)
    finals: list[np.ndarray | None] = [None] * workers
    failures: list[BaseException] = []

    def worker(rank: int, address) -> None:
        try:
            model = _model(dtype, "cuda:0")
            params = list(model.parameters())
            buffer = FlatBuffer(params, wire_dtype=torch.float64 if wire == np.float64
                                else torch.float32)
            assert buffer.flat.is_cuda and buffer.host.is_pinned()
            optimizer = torch.optim.SGD(params, lr=lr)
            mine = slice(rank * ROWS, (rank + 1) * ROWS)
            bx, by = x[mine].to("cuda:0", non_blocking=True), y[mine].to("cuda:0")
            channel = DriverChannel(address, Credential.of(secret, rank),
                                    connect_timeout=30, reply_timeout=60)
            channel.configure(config, [tuple(p.shape) for p in params], 0)
            channel.open(msg.WorkerHello(rank=rank, host="gpu"))
            channel.receive_start(buffer.array)
            buffer.scatter()
            for r in range(rounds):
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(model(bx), by)
                loss.backward()
                optimizer.step()
                loss_sum = float(loss.detach()) * ROWS
                channel.exchange(RoundReport(round=r, samples=ROWS, loss_sum=loss_sum,
                                             compute_s=0.0, setup_s=0.0, lr=lr), buffer)
            channel.done([], np.zeros(0, np.uint8))
            finals[rank] = buffer.flat.cpu().numpy().astype(wire)
            channel.close()
        except BaseException as exc:  # reported by the test, not lost in the thread
            failures.append(exc)

    start = torch.cat([p.detach().reshape(-1) for p in _model(dtype, "cpu").parameters()])
    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=workers,
                     secret=secret, timeout=60, dtype=wire, model_numel=numel,
                     check_job=lambda wait: None, step=step) as coord:
        threads = [threading.Thread(target=worker, args=(rank, coord.address))
                   for rank in range(workers)]
        for t in threads:
            t.start()
        coord.accept_workers(start.numpy().astype(wire), deadline_s=60)
        for r in range(rounds):
            coord.run_round(r, model_numel=numel, allow_state=False, evaluate=False)
        coord.finish()
        for t in threads:
            t.join(60)
        driver = coord.average.copy()
    assert not failures, failures
    return finals, driver


def test_two_gpu_replicas_averaged_every_step_equal_large_batch_sgd_on_the_cpu():
    """float64, SGD, equal batches, averaging after every step: the average of the replicas
    is one step of SGD on both batches together (the mean of the two batch-mean gradients),
    computed here by an independent model on the CPU."""
    rounds, lr = 30, 0.1
    finals, driver = _gpu_fit(rounds, torch.float64, lr=lr)
    x, y = _batches(2, torch.float64)
    reference = _model(torch.float64, "cpu")
    optimizer = torch.optim.SGD(reference.parameters(), lr=lr)
    for _ in range(rounds):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(reference(x), y).backward()
        optimizer.step()
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()]).numpy()
    moved = np.abs(expected - torch.cat([p.detach().reshape(-1) for p in
                                         _model(torch.float64, "cpu").parameters()]).numpy())
    assert moved.max() > 1e-2  # the fit went somewhere
    for final in finals:
        np.testing.assert_allclose(final, expected, rtol=0, atol=1e-10)
        assert np.array_equal(final, driver)  # the replicas hold the driver's average


@pytest.mark.parametrize("compression", ["bf16", "int8", "int4"])
def test_gpu_replicas_with_compressed_deltas_and_nesterov_hold_the_drivers_bits(compression):
    numel = sum(p.numel() for p in _model(torch.float32, "cpu").parameters())
    make = outer_factory("nesterov", None, None)
    step = GlobalStep(numel=numel, dtype=np.float32, compression=compression, warmup_rounds=2,
                      outer=OuterOptimizer(make, [(numel,)], np.zeros(0)))
    finals, driver = _gpu_fit(8, torch.float32, compression=compression, step=step)
    for final in finals:
        assert np.array_equal(final, driver)  # bit for bit, on the device too


def test_the_outer_optimizer_on_the_gpu_steps_as_on_the_cpu():
    """The collective transport runs the outer step on the task's device: Nesterov's float64
    state on CUDA follows the CPU's to rounding (same formula, other kernels)."""
    rng = np.random.default_rng(2)
    g0 = rng.standard_normal(5000)
    make = outer_factory("nesterov", None, None)
    on_cpu = OuterOptimizer(make, [(50, 100)], g0)
    on_gpu = OuterOptimizer(make, [(50, 100)], torch.from_numpy(g0).cuda(), device="cuda:0")
    for _ in range(10):
        moves = rng.standard_normal(5000) * 0.01
        a_cpu = on_cpu.theta.numpy() - moves
        a_gpu = torch.from_numpy(a_cpu.copy()).cuda()
        norm_cpu, norm_gpu = on_cpu.step(a_cpu), on_gpu.step(a_gpu)
        np.testing.assert_allclose(a_gpu.cpu().numpy(), a_cpu, rtol=0, atol=1e-13)
        assert norm_gpu == pytest.approx(norm_cpu, rel=1e-12)


def test_an_nccl_task_group_sums_and_gathers_on_the_gpu():
    """One task's NCCL group (the machine has one GPU; NCCL refuses two ranks on one device):
    the group forms over the TCP store, sums in place and gathers on cuda:0, and closes."""
    group = TaskGroup.form(rank=0, world=1, address="127.0.0.1", device=torch.device("cuda:0"),
                           all_gather=lambda message: [message], connect_timeout_s=30,
                           op_timeout_s=30)
    try:
        values = torch.arange(6, dtype=torch.float32, device="cuda:0")
        group.all_reduce_sum(values)
        assert torch.equal(values.cpu(), torch.arange(6, dtype=torch.float32))
        gathered = group.all_gather(torch.ones(3, device="cuda:0"))
        assert len(gathered) == 1 and gathered[0].is_cuda
    finally:
        group.close()
