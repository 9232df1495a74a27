"""Pure update rules of the asynchronous parameter server (no sockets, no Spark).

A worker pushes `update` = the sum of its local optimizer steps since its last push
(w_at_last_push - w_now, so the server applies w <- w - update). The rules:

- downpour (DistBelief): w <- w - update.
- DC-ASGD (Zheng et al., ICML 2017): with g = update / lr the worker's gradient,
  w <- w - lr * (g + lambda * g*g*(w - w_backup[m])), where w_backup[m] is the copy of w that
  worker m last pulled. One backup *per worker*: MXNet's single shared copy is a known error.
- DC-ASGD adaptive: lambda_t = lambda0 / sqrt(meansquare + eps) elementwise, with
  meansquare <- m * meansquare + (1 - m) * g*g updated before it is used.
- SSP (Ho et al. 2013): a worker at clock c (its pushes so far) reads only once the slowest
  worker is at c - bound; and its push waits until the others have read at c - bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

ALGORITHMS = ("downpour", "dcasgd", "dcasgd-adaptive")


@dataclass(kw_only=True, slots=True)
class ServerState:
    """The parameters and what the rules remember about each worker."""

    params: np.ndarray
    algorithm: str = "downpour"
    lr: float = 0.01
    dc_lambda: float = 0.04
    """lambda of constant DC-ASGD; lambda0 of the adaptive variant (paper default 2)."""
    momentum: float = 0.95
    eps: float = 1e-7
    update_scale: float = 1.0
    """Each push counts this much; 1/num_workers makes staleness bound 0 equal sync averaging."""
    backups: dict[int, np.ndarray] = field(default_factory=dict)
    meansquare: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm={self.algorithm!r}; use one of {ALGORITHMS}")

    def pull(self, worker: int) -> np.ndarray:
        """The parameters a worker fetches; DC-ASGD remembers them as its backup."""
        if self.algorithm != "downpour":
            backup = self.backups.get(worker)
            if backup is None or backup.shape != self.params.shape:
                self.backups[worker] = self.params.copy()
            else:
                np.copyto(backup, self.params)
        return self.params

    def apply(self, worker: int, update: np.ndarray) -> None:
        """Apply a worker's update. `update` is scratch: it may be scaled in place."""
        if self.update_scale != 1.0:
            update *= self.update_scale
        if self.algorithm == "downpour":
            self.params -= update
            return
        backup = self.backups.get(worker)
        if backup is None:  # never pulled: it trained from the initial parameters it was sent
            raise ValueError(f"worker {worker} pushed before it pulled")
        g = update / self.lr
        if self.algorithm == "dcasgd":
            lam = self.dc_lambda
        else:
            if self.meansquare is None:
                self.meansquare = np.zeros_like(self.params)
            self.meansquare *= self.momentum
            self.meansquare += (1 - self.momentum) * g * g
            lam = self.dc_lambda / np.sqrt(self.meansquare + self.eps)
        self.params -= self.lr * (g + lam * g * g * (self.params - backup))


def may_read(clocks: dict[int, int], worker: int, bound: int | None) -> bool:
    """SSP read rule: a worker at clock c reads once every worker has reached c - bound."""
    return bound is None or min(clocks.values()) >= clocks[worker] - bound


def may_apply(read_clocks: dict[int, int], worker: int, clock: int, bound: int | None) -> bool:
    """A push from a worker at `clock` waits until every *other* worker has read at clock
    - bound, so no read sees updates from beyond its round (bound 0: exactly synchronous)."""
    return bound is None or all(read >= clock - bound for w, read in read_clocks.items()
                                if w != worker)
