"""Stopping a fit before its last round, for both modes: early stopping judges each evaluation
on the history so far (`_controls.decide`), then the user's `on_round` sees the round; whichever
asks first stops the fit. With `restore_best`, the parameters of the best evaluation are kept
and returned, whoever stopped. Both decisions come from the logged rounds, which a restart
never logs twice, so a restart or a resume decides as the uninterrupted fit did."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from sparkdl_avg._controls import decide
from sparkdl_avg._errors import TrainingError

log = logging.getLogger("sparkdl_avg")


class Stopping:
    def __init__(self, rule, on_round: Callable[[dict], bool] | None = None,
                 best: np.ndarray | None = None) -> None:
        self.rule, self.on_round = rule, on_round
        self.best = best
        """restore_best: the parameters of the best evaluation so far."""
        self.stopped_by: str | None = None
        """"early_stopping" or "on_round", once one has stopped the fit."""
        self.stopped_at: dict | None = None
        """The history row at which the fit stopped."""
        self.reason = ""
        self._final: np.ndarray | None = None

    def judge(self, history: list[dict], row: dict, params: np.ndarray | None) -> bool:
        """Early stopping: `row` of `history` has just got an evaluation of `params`, the
        newest evaluation there is. Keeps them if they are the best so far (restore_best);
        True if the fit stops (now or before)."""
        if self.rule is not None and self.rule.metric in row:
            values = [r[self.rule.metric] for r in history if self.rule.metric in r]
            decision = decide(values, self.rule)
            if self.rule.restore_best and decision.best == len(values) - 1 \
                    and params is not None:
                self.best = params.copy()
            if decision.stop:
                self._stop("early_stopping", row, params, decision.reason)
        return self.stopped_by is not None

    def ask(self, row: dict, params: np.ndarray | None) -> bool:
        """`on_round` with a copy of the round's logged metrics; True if the fit stops (now
        or before). A callback that raises fails the fit."""
        if self.on_round is not None and self.stopped_by is None:
            try:
                stop = self.on_round(dict(row))
            except Exception as exc:
                raise TrainingError(f"on_round raised at round {row['round']}: "
                                    f"{type(exc).__name__}: {exc}") from exc
            if stop is not None and not isinstance(stop, (bool, np.bool_)):
                raise TrainingError(f"on_round must return True, False or None, got "
                                    f"{type(stop).__name__} at round {row['round']}")
            if stop:
                self._stop("on_round", row, params, "on_round returned True")
        return self.stopped_by is not None

    def state(self) -> dict | None:
        """The decided stop, for checkpoints."""
        if self.stopped_by is None:
            return None
        return {"by": self.stopped_by, "round": self.stopped_at["round"], "reason": self.reason}

    def take_up(self, state: dict | None, history: list[dict],
                params: np.ndarray | None) -> None:
        """A checkpoint's decided stop (`state`) on resume: the fit stops where it would
        have; `params` are the checkpoint's, of that round."""
        if state is not None and self.stopped_by is None:
            row = next((r for r in history if r["round"] == state["round"]),
                       {"round": state["round"]})
            self._stop(state["by"], row, params, state["reason"])

    def _stop(self, by: str, row: dict, params: np.ndarray | None, reason: str) -> None:
        if self.stopped_by is None:
            self.stopped_by, self.stopped_at, self.reason = by, row, reason
            self._final = None if params is None else params.copy()
            log.info("stopping at round %d (%s): %s", row["round"], by, reason)

    def result(self) -> np.ndarray | None:
        """The parameters the fit returns instead of its last ones: the best evaluation's
        (restore_best), else those of the round that stopped it; None: the last."""
        if self.rule is not None and self.rule.restore_best and self.best is not None:
            return self.best
        return self._final

    def record(self, run, history: list[dict]) -> None:
        """Who stopped the fit, where and why, and the best evaluation, in the MLflow run."""
        if self.stopped_by is not None:
            run.set_tags({"sparkdl_avg.stopped_by": self.stopped_by,
                          "sparkdl_avg.stopped_at_round": self.stopped_at["round"],
                          "sparkdl_avg.stop_reason": self.reason})
        if self.rule is None:
            return
        metric = self.rule.metric
        rows = [row for row in history if metric in row]
        decision = decide([row[metric] for row in rows], self.rule)
        if decision.best is not None:
            best = rows[decision.best]
            run.log_metrics({f"best_{metric}": best[metric], "best_round": best["round"]},
                            step=0)
