"""Which tensors train (and are averaged) and which are frozen (and fingerprinted), without
Spark: parameters by requires_grad, buffers by their module's mode, non-persistent buffers
in neither set; the modes a model trains in; the meta driver's check that an executor's
build trains the same tensors."""

from __future__ import annotations

import logging

import pytest
import torch

from sparkdl_avg import ModelError
from sparkdl_avg._model import build_model, eval_mode_trainers
from sparkdl_avg.averaging.flat_buffer import averaged_tensors, counted_buffers
from sparkdl_avg.averaging.frozen import Fingerprint, frozen_tensors
from sparkdl_avg.driver.meta_model import _check_same_trained, build_on_meta
from sparkdl_avg.driver.plan import warn_eval_mode_trainers


class Rotary(torch.nn.Module):
    """A derived constant (as rotary embeddings keep `inv_freq`), and scratch memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)
        self.register_buffer("scratch", torch.empty(8), persistent=False)


def _model():
    frozen = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    frozen.requires_grad_(False).eval()
    rotary = Rotary().eval()
    head = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.BatchNorm1d(2), Rotary())
    return torch.nn.ModuleDict({"frozen": frozen, "rotary": rotary, "head": head})


def _names(model, tensors):
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    return [names[id(t)] for t in tensors]


def test_what_trains_and_what_is_frozen():
    model = _model()
    assert _names(model, averaged_tensors(model)) == [
        "head.0.weight", "head.0.bias", "head.1.weight", "head.1.bias",
        "head.1.running_mean", "head.1.running_var"]  # a training BatchNorm's statistics
    assert list(counted_buffers(model)) == ["head.1.num_batches_tracked"]
    assert [n for n, _ in frozen_tensors(model)] == [
        "frozen.0.weight", "frozen.0.bias", "frozen.1.weight", "frozen.1.bias",
        "frozen.1.running_mean", "frozen.1.running_var", "frozen.1.num_batches_tracked"]


def test_the_fingerprint_ignores_derived_constants_and_names_the_first_difference():
    a, b = _model(), _model()
    b.load_state_dict(a.state_dict())
    b.rotary.scratch.fill_(7.0)  # uninitialised memory differs between builds: no matter
    assert Fingerprint.of(a) == Fingerprint.of(b)
    with torch.no_grad():
        b.frozen[1].running_var.add_(1.0)
    assert Fingerprint.of(a).difference(Fingerprint.of(b)) == \
        "the first differing frozen tensor is 'frozen.1.running_var'"
    assert Fingerprint.from_dict(Fingerprint.of(a).to_dict()) == Fingerprint.of(a)


def test_a_model_wholly_in_eval_mode_trains_in_training_mode():
    model = build_model(lambda: torch.nn.Sequential(torch.nn.Linear(2, 2),
                                                    torch.nn.Dropout(0.5)).eval())
    assert all(m.training for m in model.modules())
    mixed = build_model(_model)
    assert not mixed["frozen"].training and mixed["head"].training  # as model_fn left them


def test_eval_mode_modules_that_train_are_named_in_a_warning(caplog):
    def peft_like():  # from_pretrained's base in eval mode, an adapter added in training mode
        base = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.1)).eval()
        base.requires_grad_(False)
        base.add_module("adapter", torch.nn.Linear(2, 2))
        return torch.nn.Sequential(base)

    model = build_model(peft_like)
    assert eval_mode_trainers(model) == ["0"]
    with caplog.at_level(logging.WARNING, logger="sparkdl_avg"):
        warn_eval_mode_trainers(model)
    assert "1 module(s) in eval mode hold parameters that train ('0')" in caplog.text
    assert eval_mode_trainers(build_model(_model)) == []


def test_a_meta_build_must_train_what_the_executors_build_trains():
    meta = build_on_meta(_model)
    assert all(t.is_meta for t in averaged_tensors(meta))
    real = _model()
    built = [[n, list(t.shape)] for n, t in zip(_names(real, averaged_tensors(real)),
                                                averaged_tensors(real), strict=True)]
    _check_same_trained(meta, built)  # the same: no error
    built[0] = ["head.0.weight", [3, 4]]
    with pytest.raises(ModelError, match=r"\['head.0.weight', \[2, 4\]\] here, "
                                         r"\['head.0.weight', \[3, 4\]\] there"):
        _check_same_trained(meta, built)
