"""The outer optimizer (`TrainConfig.outer_optimizer`): DiLoCo's Nesterov, SlowMo's momentum,
or any `torch.optim` optimizer, stepped once a round on the pseudo-gradient.

Each round the replicas' weighted average A replaces nothing by itself: with the global
parameters G the workers started the round from, the pseudo-gradient is G - A, written into
each parameter's `.grad`, and an ordinary `torch.optim` optimizer steps G (the seam of
torchft's `local_sgd.DiLoCo`). "average" needs no optimizer: SGD with lr 1 would step G onto A
exactly (`OuterOptimizer` keeps G in float64, where G - A and G - (G - A) are exact for
float32 values of similar magnitude).

G and the optimizer's state live in float64 on the device the step runs on: the driver's CPU
with the "driver" transport, every task's device with the "collective" one (each task steps
its own copy, on the same all-reduced average, to the same bits). Only the trainable
parameters step; floating buffers (BatchNorm's statistics) and averaged optimizer state keep
the plain average."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from sparkdl_avg._errors import ConfigError

OUTER_DEFAULTS = {"nesterov": (0.7, 0.9), "momentum": (0.7, 0.9)}
"""(outer_lr, outer_momentum) when not given: DiLoCo's (Douillard et al. 2023)."""
_CHUNK = 1 << 20
_HYPERPARAMETERS = ("lr", "momentum", "dampening", "nesterov", "weight_decay", "betas", "eps",
                    "alpha", "amsgrad", "centered", "rho", "lr_decay", "maximize",
                    "decoupled_weight_decay")
"""What describes a callable outer optimizer (`_built`): not every default, which a torch
release may add to (`foreach`, `fused`), refusing resumes that would be right."""


def outer_factory(name_or_fn, lr: float | None,
                  momentum: float | None) -> Callable[[list[torch.Tensor]], Any] | None:
    """`params -> torch.optim.Optimizer` for a TrainConfig's outer settings; None for
    "average"."""
    if name_or_fn == "average":
        return None
    if callable(name_or_fn):
        return name_or_fn
    default_lr, default_momentum = OUTER_DEFAULTS[name_or_fn]
    lr = default_lr if lr is None else lr
    momentum = default_momentum if momentum is None else momentum
    nesterov = name_or_fn == "nesterov"
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=nesterov)


def outer_settings(config) -> dict:
    """The outer optimizer's settings as they take effect (defaults resolved), for
    checkpoints' fingerprints and MLflow: a callable as what it builds (`_built`)."""
    outer = config.outer_optimizer
    if callable(outer):
        return _built(outer)
    lr, momentum = OUTER_DEFAULTS.get(outer, (None, None))
    return {"outer_optimizer": outer,
            "outer_lr": config.outer_lr if config.outer_lr is not None else lr,
            "outer_momentum": config.outer_momentum if config.outer_momentum is not None
            else momentum}


def _built(make: Callable) -> dict:
    """A callable outer optimizer as the optimizer it builds over one probe parameter: its
    class and hyperparameters. Its name alone would not do: every lambda is "<lambda>", and a
    resume must tell SGD from Adam, and lr 0.7 from 0.5. By name alone if it cannot build."""
    name = getattr(make, "__qualname__", "callable")
    try:
        built = make([torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))])
        defaults = dict(built.defaults)
    except Exception:  # noqa: BLE001 - the fit's own build reports it (`OuterOptimizer`)
        return {"outer_optimizer": name, "outer_lr": None, "outer_momentum": None}
    plain = {key: value for key, value in sorted(defaults.items())
             if key in _HYPERPARAMETERS}
    kind = type(built)
    described = ", ".join(f"{key}={value!r}" for key, value in plain.items())
    return {"outer_optimizer": f"{name}: {kind.__module__}.{kind.__qualname__}({described})",
            "outer_lr": _number(defaults.get("lr")),
            "outer_momentum": _number(defaults.get("momentum"))}


def _number(value) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    return float(value) if isinstance(value, (int, float)) else None


def shapes_of(tensors: list[torch.Tensor]) -> list[tuple[int, ...]]:
    return [tuple(t.shape) for t in tensors]


class OuterOptimizer:
    """G (float64, flat) as one tensor per trainable parameter (`shapes`, views of G, so a
    user's optimizer sees the model's tensors), their gradients views of one flat buffer."""

    def __init__(self, make: Callable[[list[torch.Tensor]], Any],
                 shapes: list[tuple[int, ...]], initial: np.ndarray | torch.Tensor,
                 device: torch.device | str = "cpu") -> None:
        numel = sum(int(np.prod(s, dtype=np.int64)) for s in shapes)
        self.numel = numel
        self.theta = torch.empty(numel, dtype=torch.float64, device=device)
        self._grad = torch.zeros_like(self.theta)
        self.params: list[torch.Tensor] = []
        offset = 0
        for shape in shapes:
            n = int(np.prod(shape, dtype=np.int64))
            p = torch.nn.Parameter(torch.empty(shape, dtype=torch.float64, device=device))
            p.data = self.theta[offset:offset + n].view(shape)
            p.grad = self._grad[offset:offset + n].view(shape)
            self.params.append(p)
            offset += n
        try:
            optimizer = make(self.params)
        except Exception as exc:
            raise ConfigError(f"outer_optimizer({len(self.params)} parameters) failed: "
                              f"{exc!r}") from exc
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"outer_optimizer must return a torch.optim.Optimizer, got "
                              f"{type(optimizer).__name__}")
        self.optimizer = optimizer
        if len(initial):
            self.reset(initial)

    def reset(self, global_params: np.ndarray | torch.Tensor) -> None:
        """G becomes `global_params` (its first `numel` values): where the replicas start."""
        with torch.no_grad():
            self.theta.copy_(_tensor(global_params)[:self.numel])

    def step(self, average: np.ndarray | torch.Tensor) -> float:
        """One outer step on the pseudo-gradient G - A, A being `average`'s first `numel`
        values, which then hold the new G (in `average`'s dtype, which G takes too: the
        replicas hold it so). Returns the L2 norm of the step, G_old - G_new."""
        out = _tensor(average)
        with torch.no_grad():
            for part in _chunks(self.numel):
                self._grad[part].copy_(self.theta[part]).sub_(out[part])
                out[part].copy_(self.theta[part])  # G_old, exact in the wire's dtype
            return self._finish(out)

    def step_on(self, pseudo_gradient: np.ndarray | torch.Tensor,
                out: np.ndarray | torch.Tensor) -> float:
        """One outer step on a pseudo-gradient given as such (compressed deltas); `out`
        receives the new G in its dtype. Returns the step's L2 norm."""
        out_t = _tensor(out)
        with torch.no_grad():
            self._grad.copy_(_tensor(pseudo_gradient)[:self.numel])
            out_t[:self.numel].copy_(self.theta)
            return self._finish(out_t)

    def _finish(self, out: torch.Tensor) -> float:
        """Step, then `out` (holding G_old) becomes G_new, rounded to its dtype, and G that."""
        self.optimizer.step()
        squares = 0.0
        for part in _chunks(self.numel):
            squares += float(torch.sum((out[part].double() - self.theta[part]) ** 2))
            out[part].copy_(self.theta[part])
            self.theta[part].copy_(out[part])
        return squares ** 0.5

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def _tensor(values: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(values) if isinstance(values, np.ndarray) else values


def _chunks(numel: int):
    for start in range(0, numel, _CHUNK):
        yield slice(start, min(start + _CHUNK, numel))
