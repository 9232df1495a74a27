"""Early stopping on the driver, for both modes: after each evaluation the history so far
decides (`_controls.decide`), and with `restore_best` the parameters of the best evaluation are
kept. The decision is a function of the logged history, so a restart or a resume that redoes
rounds decides as the uninterrupted fit did."""

from __future__ import annotations

import logging

import numpy as np

from sparkdl_avg._controls import decide

log = logging.getLogger("sparkdl_avg")


class EarlyStopper:
    def __init__(self, rule, best: np.ndarray | None = None) -> None:
        self.rule = rule
        self.best = best
        """restore_best: the parameters of the best evaluation so far."""
        self.stopped_at: dict | None = None
        """The history row whose evaluation stopped the fit."""
        self.reason = ""
        self._final: np.ndarray | None = None
        self.stopped_sent = False
        """Async: the parameter server was told to stop."""

    @property
    def on(self) -> bool:
        return self.rule is not None

    def observe(self, history: list[dict], params: np.ndarray | None,
                row: dict | None = None) -> bool:
        """`row` (default: the newest of `history`) has just got an evaluation of `params`,
        the newest evaluation there is: keep them if it is the best so far (restore_best),
        and say whether the fit stops here."""
        row = history[-1] if row is None else row
        if self.rule is None or self.rule.metric not in row:
            return False
        values = [row[self.rule.metric] for row in history if self.rule.metric in row]
        decision = decide(values, self.rule)
        if self.rule.restore_best and decision.best == len(values) - 1 and params is not None:
            self.best = params.copy()
        if decision.stop and self.stopped_at is None:
            self.stopped_at, self.reason = row, decision.reason
            self._final = None if params is None else params.copy()
            log.info("early stopping at round %d: %s", row["round"], decision.reason)
        return decision.stop

    def result(self) -> np.ndarray | None:
        """The parameters the fit returns instead of its last ones: the best evaluation's
        (restore_best), else those of the evaluation that stopped it; None: the last."""
        if self.rule is None:
            return None
        if self.rule.restore_best and self.best is not None:
            return self.best
        return self._final

    def record(self, run, history: list[dict]) -> None:
        """Where the fit stopped and why, and the best evaluation, in the MLflow run."""
        if self.rule is None:
            return
        metric = self.rule.metric
        rows = [row for row in history if metric in row]
        decision = decide([row[metric] for row in rows], self.rule)
        tags = {"sparkdl_avg.early_stopping": "stopped" if self.stopped_at else "ran to the end"}
        if self.stopped_at is not None:
            tags.update({"sparkdl_avg.stopped_at_round": self.stopped_at["round"],
                         "sparkdl_avg.stop_reason": self.reason})
        run.set_tags(tags)
        if decision.best is not None:
            best = rows[decision.best]
            run.log_metrics({f"best_{metric}": best[metric], "best_round": best["round"]},
                            step=0)
