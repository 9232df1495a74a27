"""A worker's optimizer state and integer buffers survive the trip through a checkpoint."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sparkdl_avg import ModelError, ProtocolError, TrainConfig
from sparkdl_avg._model import make_optimizer
from sparkdl_avg.task.worker_state import pack, restore


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8, momentum=None),
                               torch.nn.Linear(8, 3))


def steps(m, opt, n: int) -> None:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("config", [TrainConfig(optimizer="adam"),
                                    TrainConfig(optimizer="sgd", momentum=0.9)])
def test_a_restored_replica_continues_exactly_like_the_original(config):
    a = model()
    opt_a = make_optimizer(config, a.parameters())
    steps(a, opt_a, 3)
    b = model()
    b.load_state_dict({k: v for k, v in a.state_dict().items()
                       if v.is_floating_point()}, strict=False)  # what averaging carries
    opt_b = make_optimizer(config, b.parameters())
    layout, payload = pack(opt_a, a)
    restore(opt_b, b, layout, payload.tobytes())  # as bytes off the wire
    assert int(b[1].num_batches_tracked) == 3
    steps(a, opt_a, 3)
    steps(b, opt_b, 3)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def channels_last_cnn() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
        torch.nn.Linear(4 * 4 * 4, 2)).to(memory_format=torch.channels_last)


def cnn_steps(m, opt, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
    y = torch.randint(0, 2, (8,), generator=g)
    for _ in range(n):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()


@pytest.mark.parametrize("fused", [True, False])
def test_restored_adam_state_keeps_a_channels_last_parameters_layout(fused):
    """Packing flattens the moments in logical order; restored contiguous, the fused step
    (which walks a parameter, its gradient and its moments as one flat block) mixed up the
    elements of a channels_last kernel's: 0.33 apart from the uninterrupted run after 3
    steps. Restored in the parameter's layout, the run after a restore is the same run."""
    from sparkdl_avg.averaging.flat_buffer import FlatBuffer, averaged_tensors

    def replica():
        m = channels_last_cnn()
        FlatBuffer(averaged_tensors(m), torch.float32)  # as a worker holds it
        return m, torch.optim.Adam(m.parameters(), lr=0.1, fused=fused)

    a, opt_a = replica()
    cnn_steps(a, opt_a, 3)
    b, opt_b = replica()
    b.load_state_dict(a.state_dict())
    restore(opt_b, b, *pack(opt_a, a))
    kernel = b[0].weight
    assert not kernel.is_contiguous() and kernel.is_contiguous(
        memory_format=torch.channels_last)
    for p in b.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert opt_b.state[p][key].stride() == p.stride(), key
    cnn_steps(a, opt_a, 3)
    cnn_steps(b, opt_b, 3)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_malformed_layouts_are_refused():
    m = model()
    opt = make_optimizer(TrainConfig(optimizer="adam"), m.parameters())
    for layout in ([[0, "exp_avg", "tensor", "float32", [8, 4], 0, 10**9]],
                   [[0, "exp_avg", "tensor", "object", [1], 0, 4]],
                   [[-1, "no_such_buffer", "tensor", "int64", [], 0, 8]],
                   [["x"]]):
        with pytest.raises(ProtocolError, match="malformed optimizer state"):
            restore(opt, m, layout, np.zeros(8, np.uint8))


def test_state_that_cannot_be_checkpointed_is_a_model_error():
    m = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    opt.state[m.weight]["history"] = [1, 2]  # a list: not a tensor or a number
    with pytest.raises(ModelError, match="cannot be checkpointed"):
        pack(opt, m)


def test_the_fp16_gradient_scaler_travels_with_the_optimizer_state():
    """fp16's scaler (its scale and growth counter) is part of a checkpoint: restored, a
    restarted worker scales its losses as the original did."""
    model = torch.nn.Linear(3, 2)
    opt = make_optimizer(TrainConfig(optimizer="adam"), model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    scaler.scale(torch.ones(()))  # the scale exists once a loss has been scaled
    scaler.update(512.0)  # as after a step that overflowed
    layout, payload = pack(opt, model, scaler)
    fresh = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=5)
    restore(make_optimizer(TrainConfig(optimizer="adam"), model.parameters()), model, layout,
            payload, scaler=fresh)
    assert fresh.get_scale() == 512.0
    assert fresh.state_dict() == scaler.state_dict()
