"""Update rules of the asynchronous parameter server, in a registry (no sockets, no Spark).

A worker pushes `update` = the sum of its local optimizer steps since its last push
(w_at_last_push - w_now, so the server applies w <- w - update). Each rule scales what it
applies by `update_scale` (1/num_workers in a fit's own server) itself: it receives the
update as the worker sent it, since DC-ASGD also needs the unscaled update (the step the
worker itself took). The rules:

- downpour (DistBelief): w <- w - update_scale * update.
- dcasgd (Zheng et al., ICML 2017): with g = update_scale * update / lr the worker's gradient,
  w <- w - lr * (g + lambda * g*g*(w - w_backup[m])), where w_backup[m] is the point worker
  m computed its update from. One backup *per worker*: MXNet's single shared copy is a known
  error. A pull sets it to the parameters pulled; each push then moves it by the worker's own
  update, unscaled (w_backup[m] -= update), since a worker that pushes again before it pulls
  (fetch_every > push_every) goes on from its own parameters, which moved by the whole update
  while the server applied only update_scale of it. Without that, the worker's own earlier
  pushes would count as staleness.
- dcasgd-adaptive: lambda_t = lambda0 / sqrt(meansquare + eps) elementwise, with
  meansquare <- m * meansquare + (1 - m) * g*g updated before it is used.

Only the first `gradients` values are parameters a gradient moved (the fit's trainable ones,
`averaging.flat_buffer.averaged_tensors`); what follows them (BatchNorm's running statistics)
moves by what the workers measured, not by lr times a gradient. DC-ASGD applies those as
Downpour does: read as g = update / lr, a statistic's change would grow as 1/lr, and so would
its compensation, driving a running variance negative.

Every rule computes into spare arrays and swaps them in only when everything it computed is
finite: an update or an lr that would overflow (two updates of 3e38 in float32; DC-ASGD's
g = update / lr with lr = 1e-300) is refused and changes nothing (`apply` returns False). So
is an update holding NaN or Inf: every element of it reaches a checked value (a NaN or Inf
times any update_scale is not finite, and DC-ASGD's backup takes the update unscaled), so
the server makes no pass of its own over it. The spares are preallocated once, so the check
costs no allocation per update: the result is computed and checked in cache-sized chunks
(`CHUNK`). The arrays swap roles: the `params` array a rule is made with becomes one of its
spares after the first update it applies (scratch, overwritten by later ones), so a caller
that keeps using it must pass a copy.

A new rule is one class here, decorated with `@register`: its name, its defaults and its
`_step`, which must apply `update_scale` itself, commit only finite results and let every
NaN or Inf of the update reach a checked value. Everything else (TrainConfig's check, the
command line's choices) reads `RULES`.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np

RULES: dict[str, type[UpdateRule]] = {}
CHUNK = 1 << 16
"""Elements computed and checked at a time (as `averaging.arithmetic`): the temporaries
stay in cache."""


def register(cls: type[UpdateRule]) -> type[UpdateRule]:
    RULES[cls.name] = cls
    return cls


class UpdateRule:
    """The parameters and what the rule remembers about each worker."""

    name: ClassVar[str]
    PARAMETERS: ClassVar[tuple[str, ...]] = ()
    """The optional settings the rule reads (beyond lr and update_scale)."""

    def __init__(self, params: np.ndarray, *, lr: float = 0.01, update_scale: float = 1.0,
                 dc_lambda: float | None = None, gradients: int | None = None) -> None:
        self.params = params
        self.lr = lr
        self.update_scale = update_scale
        self.gradients = params.size if gradients is None else min(gradients, params.size)
        """The leading values a gradient moves; the rest are statistics (module doc)."""
        self._spares: dict[str, np.ndarray] = {}

    def settings(self) -> dict[str, float]:
        """The rule's own settings with its defaults filled in (reported on INIT)."""
        return {}

    def pull(self, worker: int) -> np.ndarray:
        """The parameters a worker fetches."""
        return self.params

    def apply(self, worker: int, update: np.ndarray, lr: float | None = None) -> bool:
        """Apply a worker's update, computed at learning rate `lr` (None: the server's).
        `update` is scratch: a rule may scale it in place. Returns False, having changed
        nothing, where the result would not be finite. Raises ValueError for an update the
        rule cannot take."""
        if update.shape != self.params.shape:  # the chunks would apply a part of it
            raise ValueError(f"an update of {update.size} values for {self.params.size} "
                             "parameters")
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # refused, not warned
            return self._step(worker, update, self.lr if lr is None else lr)

    def _step(self, worker: int, update: np.ndarray, lr: float) -> bool:
        """`update` as the worker sent it (not yet scaled by `update_scale`)."""
        raise NotImplementedError

    def _spare(self, name: str) -> np.ndarray:
        """A preallocated array like the parameters, to compute a candidate into."""
        spare = self._spares.get(name)
        if spare is None or spare.shape != self.params.shape:
            spare = self._spares[name] = np.empty_like(self.params)
        return spare

    def _swap(self, name: str, current: np.ndarray, candidate: np.ndarray) -> np.ndarray:
        """Commit `candidate` (the spare `name`); `current` becomes the spare."""
        self._spares[name] = current
        return candidate

    def state(self) -> dict[str, np.ndarray]:
        """Arrays to checkpoint beside the parameters."""
        return {}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        """Take up what `state` saved."""


@register
class Downpour(UpdateRule):
    name = "downpour"

    def _step(self, worker: int, update: np.ndarray, lr: float) -> bool:
        new = self._spare("params")
        for s in chunks(new.size):
            u = update[s]
            if self.update_scale != 1.0:
                u *= self.update_scale
            np.subtract(self.params[s], u, out=new[s])
            if not finite(new[s]):
                return False
        self.params = self._swap("params", self.params, new)
        return True


@register
class DcAsgd(UpdateRule):
    name = "dcasgd"
    PARAMETERS = ("dc_lambda",)
    DEFAULT_LAMBDA: ClassVar[float] = 0.04
    """MXNet's default for constant lambda."""

    def __init__(self, params: np.ndarray, *, lr: float = 0.01, update_scale: float = 1.0,
                 dc_lambda: float | None = None, gradients: int | None = None) -> None:
        super().__init__(params, lr=lr, update_scale=update_scale, gradients=gradients)
        self.dc_lambda = self.DEFAULT_LAMBDA if dc_lambda is None else dc_lambda
        self.backups: dict[int, np.ndarray] = {}

    def settings(self) -> dict[str, float]:
        return {"dc_lambda": self.dc_lambda}

    def pull(self, worker: int) -> np.ndarray:
        backup = self.backups.get(worker)  # where this worker's next update is computed
        if backup is None or backup.shape != self.params.shape:
            self.backups[worker] = self.params.copy()
        else:
            np.copyto(backup, self.params)
        return self.params

    def _step(self, worker: int, update: np.ndarray, lr: float) -> bool:
        backup = self.backups.get(worker)
        if backup is None:  # never pulled: it trained from the initial parameters it was sent
            raise ValueError(f"worker {worker} pushed before it pulled")
        step = lr != 0  # at zero (a schedule's) the update is zero, and g is undefined
        new, new_backup = self._spare("params"), self._spare("backup")
        for s in chunks(new.size):
            params, u = self.params[s], update[s]
            g_end = max(0, min(s.stop, self.gradients) - s.start)  # this chunk's gradients
            g_part = slice(s.start, s.start + g_end)
            if step and g_end:
                g = u[:g_end] * self.update_scale
                g /= lr
                lam = self._lambda(g, g_part)
                np.subtract(params[:g_end],
                            lr * (g + lam * g * g * (params[:g_end] - backup[g_part])),
                            out=new[g_part])
            elif g_end:
                new[g_part] = params[:g_end]
            # statistics, as Downpour applies them (module doc)
            np.subtract(params[g_end:], u[g_end:] * self.update_scale, out=new[s][g_end:])
            # the worker moved by all of it: its next update starts there
            np.subtract(backup[s], u, out=new_backup[s])
            if not (finite(new_backup[s]) and finite(new[s])):
                return False
        self.params = self._swap("params", self.params, new)
        if step:
            self._commit_lambda()
        self.backups[worker] = self._swap("backup", backup, new_backup)
        return True

    def _lambda(self, g: np.ndarray, s: slice) -> float | np.ndarray:
        """Lambda for the chunk `s` of the parameters; a candidate, like the step's."""
        return self.dc_lambda

    def _commit_lambda(self) -> None:
        """The step is finite: what `_lambda` computed becomes the rule's state."""


@register
class AdaptiveDcAsgd(DcAsgd):
    name = "dcasgd-adaptive"
    DEFAULT_LAMBDA = 2.0
    """lambda0 of the paper."""
    MOMENTUM: ClassVar[float] = 0.95
    EPS: ClassVar[float] = 1e-7

    def __init__(self, params: np.ndarray, *, lr: float = 0.01, update_scale: float = 1.0,
                 dc_lambda: float | None = None, gradients: int | None = None) -> None:
        super().__init__(params, lr=lr, update_scale=update_scale, dc_lambda=dc_lambda,
                         gradients=gradients)
        self.meansquare: np.ndarray | None = None

    def _lambda(self, g: np.ndarray, s: slice) -> np.ndarray:
        if self.meansquare is None:
            self.meansquare = np.zeros_like(self.params)
        if "meansquare" not in self._spares:  # zero where no gradient is: never written there
            self._spares["meansquare"] = np.zeros_like(self.params)
        new = self._spare("meansquare")[s]
        np.multiply(self.meansquare[s], self.MOMENTUM, out=new)
        new += (1 - self.MOMENTUM) * g * g
        # a mean square that overflows refuses the step: NaN makes its result non-finite
        return self.dc_lambda / np.sqrt(new + self.EPS) if finite(new) else np.nan

    def _commit_lambda(self) -> None:
        if self.meansquare is not None:  # None: no gradient stepped (a shard of statistics)
            self.meansquare = self._swap("meansquare", self.meansquare,
                                         self._spare("meansquare"))

    def state(self) -> dict[str, np.ndarray]:
        return {} if self.meansquare is None else {"meansquare": self.meansquare.copy()}

    def load_state(self, arrays: dict[str, np.ndarray]) -> None:
        self.meansquare = arrays.get("meansquare")


ALGORITHMS = tuple(RULES)


def chunks(size: int):
    """Slices of `CHUNK` elements covering 0..size."""
    return (slice(lo, lo + CHUNK) for lo in range(0, size, CHUNK))


def finite(array: np.ndarray) -> bool:
    """A finite sum means every element is finite (NaN and Inf propagate); only a sum that
    overflows needs the element-wise check, which allocates."""
    return bool(np.isfinite(array.sum()) or np.isfinite(array).all())


def make_rule(algorithm: str, params: np.ndarray, *, lr: float = 0.01,
              update_scale: float = 1.0, dc_lambda: float | None = None,
              gradients: int | None = None) -> UpdateRule:
    """`gradients`: the leading values a gradient moves (None: all; module doc)."""
    if algorithm not in RULES:
        raise ValueError(f"algorithm={algorithm!r}; use one of {ALGORITHMS}")
    return RULES[algorithm](params, lr=lr, update_scale=update_scale, dc_lambda=dc_lambda,
                            gradients=gradients)
