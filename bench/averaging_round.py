"""One averaging round (send, average, return) of a 25M-parameter float32 model, 2 workers,
local[2]: sparkdl-avg's channel vs Spark broadcast + treeReduce of the broadcast value
(the strongest Spark-only way: no zero array shipped in a closure, no copy of the broadcast).
Ours both ways, alternating fits in one session: through shared memory (the default where
the workers share the driver's host, as here) and over loopback TCP (`shared_memory=False`,
what workers on other hosts use).

Our side is timed twice: from inside (each round's communication + averaging time, as the
driver logs it) and from outside (a fit's wall time per extra round, compute included: the
difference between fits of 2R and R rounds, divided by R).

    python bench/averaging_round.py [--rounds 15]
    python bench/averaging_round.py --tls [--rounds 10]   # TCP rounds, plain vs TLS
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402

PARAMS = 25_000_000


def model_fn():
    import torch

    return torch.nn.Linear(5000, 5000)  # 25,005,000 float32 parameters (100 MB)


def sparkdl_avg_rounds(spark, rounds: int, **fields) -> list[float]:
    """Exchange time per round from a real fit: round wall time minus local compute."""
    return _fit(spark, rounds, **fields)[0]


def sparkdl_avg_outside(spark, rounds: int, **fields) -> float:
    """Wall seconds per round from outside `fit`, compute included: fits of 2R and R rounds,
    the difference divided by R (what the fit's fixed costs do not explain)."""
    return (_fit(spark, 2 * rounds, **fields)[1] - _fit(spark, rounds, **fields)[1]) / rounds


def _fit(spark, rounds: int, **fields) -> tuple[list[float], float]:
    import numpy as np
    import pandas as pd

    from sparkdl_avg import TrainConfig, fit

    df = spark.createDataFrame(pd.DataFrame({
        "features": list(np.zeros((2 * rounds, 5000), np.float32)), "label": [0] * (2 * rounds)
    }))
    cfg = TrainConfig(num_workers=2, epochs=1, batch_size=1, averaging_frequency=1, lr=1e-3,
                      shuffle=False, log_model=False, **fields)
    started = time.perf_counter()
    result = fit(df, model_fn, cfg)
    wall = time.perf_counter() - started
    return [h["time_communication_s"] + h["time_averaging_s"] for h in result.history[1:]], wall


def broadcast_tree_reduce_rounds(spark, rounds: int) -> list[float]:
    import numpy as np

    sc = spark.sparkContext
    params = np.random.default_rng(0).normal(size=PARAMS).astype(np.float32)
    rdd = sc.parallelize([0, 1], 2).cache()
    rdd.count()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        bc = sc.broadcast(params)
        total = rdd.map(lambda _, bc=bc: bc.value).treeReduce(lambda a, b: a + b, depth=2)
        params = total / 2
        bc.unpersist(blocking=True)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--tls", action="store_true",
                        help="instead: the same rounds over plain TCP and over TLS")
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    spark = local_session(2, **{"spark.driver.maxResultSize": "2g",
                                "spark.driver.memory": "6g"})
    if args.tls:
        try:
            return tls_cost(spark, args.rounds)
        finally:
            spark.stop()
    try:
        ours, tcp = [], []
        for _ in range(2):  # alternating, so drift hits both
            ours += sparkdl_avg_rounds(spark, args.rounds)
            tcp += sparkdl_avg_rounds(spark, args.rounds, shared_memory=False)
        outside = sparkdl_avg_outside(spark, args.rounds)
        outside_tcp = sparkdl_avg_outside(spark, args.rounds, shared_memory=False)
        spark_way = broadcast_tree_reduce_rounds(spark, args.rounds)
    finally:
        spark.stop()
    report("averaging_round", {
        "parameters": PARAMS, "workers": 2, "rounds": 2 * args.rounds,
        "sparkdl_avg_median_s": median(ours),
        "sparkdl_avg_tcp_median_s": median(tcp),
        "tcp_over_shared_memory": median(tcp) / median(ours),
        "sparkdl_avg_outside_per_round_s": outside,
        "sparkdl_avg_tcp_outside_per_round_s": outside_tcp,
        "broadcast_treeReduce_median_s": median(spark_way),
        "speedup": median(spark_way) / median(ours),
        "speedup_tcp": median(spark_way) / median(tcp),
        "speedup_from_outside": median(spark_way) / outside,
        "sparkdl_avg_s": ours, "sparkdl_avg_tcp_s": tcp, "broadcast_treeReduce_s": spark_way,
    })


def tls_cost(spark, rounds: int) -> None:
    """The same fit's rounds over plain TCP and over TLS (a self-signed certificate), in one
    session, alternating so drift hits both. Both over TCP (`shared_memory=False`): through
    shared memory, TLS would carry only the frames' headers."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from pathlib import Path

    from test_ps_tls import self_signed

    cert, key, _ = self_signed(Path(tempfile.mkdtemp()))
    plain, tls = [], []
    for _ in range(2):
        plain += sparkdl_avg_rounds(spark, rounds, shared_memory=False)
        tls += sparkdl_avg_rounds(spark, rounds, shared_memory=False, tls_cert=str(cert),
                                  tls_key=str(key))
    report("averaging_round_tls", {
        "parameters": PARAMS, "workers": 2, "rounds": 2 * rounds,
        "plain_median_s": median(plain), "tls_median_s": median(tls),
        "tls_over_plain": median(tls) / median(plain), "plain_s": plain, "tls_s": tls,
    })


if __name__ == "__main__":
    main()
