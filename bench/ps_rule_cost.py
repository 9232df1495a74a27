"""What checking the result of every update costs the parameter server (issue 33): each rule
as it is (computing into preallocated spares in chunks, checking them, swapping them in)
against the unchecked in-place arithmetic it replaced, on one thread, per update of a
25M-parameter float32 model; and the server's own NaN/Inf pass over the update, which the
rules' check made redundant (dropped). The best of `--reps` runs of each, in turns; the
machine's load is recorded with the result.

    nice -n 5 python bench/ps_rule_cost.py [--numel 25000000] [--reps 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import report  # noqa: E402

from sparkdl_avg.ps.rules import make_rule  # noqa: E402

LR, SCALE, LAMBDA = 0.1, 0.25, 0.04


def unchecked(algorithm: str, params: np.ndarray, backup: np.ndarray, meansquare: np.ndarray,
              update: np.ndarray) -> None:
    """The rules' arithmetic before the check, in place (as on main before issue 33)."""
    if algorithm == "downpour":
        update *= SCALE
        params -= update
        return
    g = update * SCALE
    g /= LR
    if algorithm == "dcasgd":
        lam = LAMBDA
    else:
        meansquare *= 0.95
        meansquare += 0.05 * g * g
        lam = 2.0 / np.sqrt(meansquare + 1e-7)
    params -= LR * (g + lam * g * g * (params - backup))
    backup -= update


def best_of_alternating(a, b, reps: int) -> tuple[float, float]:
    """The best time of each, run in turns: a loaded machine's drift hits both alike."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for fn, out in ((a, times[0]), (b, times[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return min(times[0]), min(times[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=25_000_000)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal(args.numel, dtype=np.float32)
    pushed = rng.standard_normal(args.numel, dtype=np.float32) * np.float32(1e-3)
    results = {}
    for algorithm in ("downpour", "dcasgd", "dcasgd-adaptive"):
        rule = make_rule(algorithm, w0.copy(), lr=LR, update_scale=SCALE)
        rule.pull(0)
        update = np.empty_like(pushed)

        def checked(rule=rule, update=update):
            np.copyto(update, pushed)
            assert rule.apply(0, update)

        params, backup, ms = w0.copy(), w0.copy(), np.zeros_like(w0)

        def plain(params=params, backup=backup, ms=ms, update=update, algorithm=algorithm):
            np.copyto(update, pushed)
            unchecked(algorithm, params, backup, ms, update)

        checked()  # the spares are allocated at the first update
        plain()
        old, new = best_of_alternating(plain, checked, args.reps)
        results[algorithm] = {"unchecked_ms": round(old * 1e3, 1),
                              "checked_ms": round(new * 1e3, 1),
                              "ratio": round(new / old, 2),
                              "spare_mb": round(sum(a.nbytes for a in
                                                    rule._spares.values()) / 2 ** 20)}
    # The server's own NaN/Inf pass over each update, before any rule (main's), is dropped:
    # every rule's check of its result refuses such an update. What it cost:
    update_pass, _ = best_of_alternating(lambda: np.isfinite(pushed).all(), lambda: None,
                                         args.reps)
    report("ps_rule_cost", {"numel": args.numel, "dtype": "float32", "reps": args.reps,
                            "dropped_update_pass_ms": round(update_pass * 1e3, 1),
                            "note": "best of reps, one thread; each time includes copying "
                                    "the update into the scratch buffer (the server's "
                                    "receive buffer is reused the same way)",
                            "rules": results, "load": os.getloadavg()})


if __name__ == "__main__":
    main()
