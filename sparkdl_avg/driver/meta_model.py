"""A driver that holds no frozen weights (`driver_model="meta"`). It builds `model_fn` on the
meta device, which gives shapes and the trainable set at no memory cost; one executor builds
it for real (`task.initial_build`) and hands back what trains, its counted buffers and the
frozen tensors' fingerprint; the driver makes only those tensors real. After the fit, the
whole model is assembled on request (`assemble`): `model_fn` built again under the fit's
seed, its fingerprint checked, the trained state copied in."""

from __future__ import annotations

import json
from functools import partial

import numpy as np
import torch

from sparkdl_avg._errors import ClusterError, ModelError, from_task
from sparkdl_avg._model import build_model
from sparkdl_avg.averaging.flat_buffer import averaged_tensors, counted_buffers, wire_dtype
from sparkdl_avg.averaging.frozen import Fingerprint
from sparkdl_avg.driver.probe import TaggedJob
from sparkdl_avg.task import worker_state
from sparkdl_avg.task.initial_build import FIELDS, build_task
from sparkdl_avg.task.report import struct_type


def build_on_meta(model_fn) -> torch.nn.Module:
    """`model_fn()` with the meta device as the default: every tensor it creates has a shape
    and a dtype but no storage."""
    with torch.device("meta"):
        return build_model(model_fn)


def initial_state(spark, model: torch.nn.Module, *, pickled: dict, seed: int, probe: dict,
                  deadline_s: float) -> dict:
    """Build `model_fn` on one executor, check it takes the data (`probe`: the keywords of
    `_model.check_model_takes_data` that say what the probe runs on: schema, ranges,
    longest, and with `fit(preprocess=)` the sample's batch), make the meta `model`'s
    trained tensors and counted buffers real with its values; returns the frozen tensors'
    fingerprint (`Fingerprint.to_dict`). ModelError if the build failed or trains other
    tensors than the meta build; ClusterError if the job failed or passed `deadline_s`."""
    dtype = str(_trained_dtype(model)).removeprefix("torch.")
    payload = {"model_fn": pickled["model_fn"], "loss": pickled["loss"], "seed": seed,
               "dtype": dtype, "probe": probe}
    what = "the initial build of model_fn on an executor (driver_model='meta')"
    frame = spark.range(1, numPartitions=1)
    rows = TaggedJob(spark, lambda: frame.mapInArrow(
        partial(build_task, payload), struct_type(FIELDS)).collect(), what).run(deadline_s)
    if rows is None:
        raise ClusterError(f"{what} did not finish within {deadline_s:.0f} s")
    rows.sort(key=lambda r: r["part"])
    if rows[0]["error"]:
        raise from_task(what, rows[0]["error"])
    meta = json.loads(rows[0]["meta"])
    _check_same_trained(model, meta["trained"])
    wire = str(wire_dtype(_trained_dtype(model))).removeprefix("torch.")
    values = np.frombuffer(b"".join(r["values"] for r in rows), dtype=np.dtype(wire))
    _make_real(model)
    _fill(model, values)
    worker_state.restore(None, model, meta["layout"],
                         np.frombuffer(bytes.fromhex(meta["counted"]), np.uint8))
    return meta["frozen"]


def _check_same_trained(model: torch.nn.Module, built: list) -> None:
    """ModelError unless the executor's build trains the meta build's tensors, in its order,
    by name and shape (`model_fn` branching on the meta device would misplace values)."""
    names = {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}
    mine = [[names[id(t)], list(t.shape)] for t in averaged_tensors(model)]
    if mine != built:
        first = next((f"{a} here, {b} there" for a, b in zip(mine, built, strict=False)
                      if a != b), f"{len(mine)} tensors here, {len(built)} there")
        raise ModelError(f"model_fn trains other tensors built on the meta device than on an "
                         f"executor (first difference, as [name, shape]: {first}); it must "
                         "build the same model on both")


def _trained_dtype(model: torch.nn.Module) -> torch.dtype:
    return averaged_tensors(model)[0].dtype


def _make_real(model: torch.nn.Module) -> None:
    """Replace each trained tensor and counted buffer of `model` (on meta) by a CPU tensor of
    its shape and dtype, in every module that holds it (tied weights stay tied)."""
    targets = {id(t) for t in averaged_tensors(model)}
    targets |= {id(b) for b in counted_buffers(model).values()}
    real: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or id(t) not in targets:
                    continue
                if id(t) not in real:
                    value = torch.zeros(t.shape, dtype=t.dtype)
                    real[id(t)] = torch.nn.Parameter(value, requires_grad=t.requires_grad) \
                        if isinstance(t, torch.nn.Parameter) else value
                store[name] = real[id(t)]


def _fill(model: torch.nn.Module, values: np.ndarray) -> None:
    tensors = averaged_tensors(model)
    if values.size != sum(t.numel() for t in tensors):
        raise ModelError(f"the executor's build of model_fn trains {values.size} values, the "
                         f"driver's meta build {sum(t.numel() for t in tensors)}: model_fn "
                         "must build the same model on the meta device")
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(torch.from_numpy(values[offset:offset + n].copy()).view(t.shape))
            offset += n


def assemble(model_fn, seed: int, trained: torch.nn.Module, frozen: dict) -> torch.nn.Module:
    """The whole trained model, on the CPU, in eval mode: `model_fn` built under the fit's
    seed (its frozen tensors must be the fit's: ModelError naming the first that is not),
    with `trained`'s trained tensors and counted buffers copied in. The caller's random
    state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build_model(model_fn).cpu()
    where = Fingerprint.from_dict(frozen).difference(Fingerprint.of(model))
    if where is not None:
        raise ModelError(f"model_fn built other frozen weights on the driver than the fit "
                         f"trained with ({where}); it must build the same ones every time")
    with torch.no_grad():
        for dst, src in zip(averaged_tensors(model), averaged_tensors(trained), strict=True):
            dst.copy_(src)
        counted = counted_buffers(trained)
        for name, b in counted_buffers(model).items():
            b.copy_(counted[name])
    return model.eval()
