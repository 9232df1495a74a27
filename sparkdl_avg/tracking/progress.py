"""Driver-side progress: a tqdm bar on a terminal, periodic log lines otherwise."""

from __future__ import annotations

import logging
import sys
import time

log = logging.getLogger("sparkdl_avg")
_LOG_EVERY_S = 5.0


class Progress:
    def __init__(self, total_rounds: int, *, interactive: bool | None = None) -> None:
        self.total = total_rounds
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self._bar = None
        self._last_log = 0.0
        if self.interactive:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_rounds, desc="sparkdl-avg", unit="round")

    def update(self, round_index: int, train_loss: float, eval_accuracy: float | None) -> None:
        fields = {"loss": f"{train_loss:.4f}"}
        if eval_accuracy is not None:
            fields["acc"] = f"{eval_accuracy:.3f}"
        if self._bar is not None:
            self._bar.set_postfix(fields, refresh=False)
            self._bar.update(1)
            return
        now = time.monotonic()
        last = round_index + 1 == self.total
        if last or now - self._last_log >= _LOG_EVERY_S:
            self._last_log = now
            text = " ".join(f"{k}={v}" for k, v in fields.items())
            log.info("round %d/%d %s", round_index + 1, self.total, text)

    def first(self, metrics: dict[str, float]) -> None:
        """Round 0: the evaluation before training, said once (no round of the bar)."""
        shown = {k: metrics[k] for k in ("eval_loss", "eval_accuracy") if k in metrics}
        text = " ".join(f"{k}={v:.4f}" for k, v in shown.items())
        if self._bar is not None:
            self._bar.set_postfix({"eval": text}, refresh=True)
            return
        log.info("round 0/%d (before training) %s", self.total, text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
