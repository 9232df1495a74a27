"""Sharded parameter server on loopback: push + pull throughput with 1, 2 and 4 shards and 4
client processes, on a model of a few million float32 parameters; the median of a few
repeats per shard count. Each shard is a `ps serve` process (as a fit's sidecars are), each
client a `connect()`ed client (a `ShardedClient` for more than one shard), and every run
checks that each shard applied exactly the pushes the clients saw acknowledged.

    python bench/ps_shard_throughput.py [--params 4000000] [--seconds 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import median, report  # noqa: E402
from ps_throughput import run_clients  # noqa: E402

from sparkdl_avg.ps.server import DRIVER  # noqa: E402
from sparkdl_avg.ps.settings import ServerSettings  # noqa: E402
from sparkdl_avg.ps.sharded_client import connect  # noqa: E402
from sparkdl_avg.ps.sidecar import Sidecar  # noqa: E402

SECRET = os.urandom(32)


def run(shards: int, clients: int, numel: int, seconds: float) -> dict:
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(Sidecar(ServerSettings(timeout=120), host="127.0.0.1",
                                               secret=SECRET)) for _ in range(shards)]
        addresses = [("127.0.0.1", s.port) for s in servers]
        driver = stack.enter_context(connect(addresses, secret=SECRET, worker=DRIVER,
                                             numel=numel, dtype=np.float32, timeout=60))
        driver.init(np.zeros(numel, np.float32))
        acks, wall = run_clients(addresses, SECRET, clients, numel, seconds)
        stats = driver.stats()
    pushes = sum(acks.values())
    applied = [s["applied"] for s in stats.get("shards", [stats])]
    return {"seconds": wall, "pushes_acked": pushes, "applied_per_shard": applied,
            "lost_or_doubled": any(a != pushes for a in applied),
            # each acknowledged push was followed by a pull of the whole model
            "GB_per_s": pushes * numel * 4 * 2 / wall / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--params", type=int, default=4_000_000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shards", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    runs: dict[int, list[dict]] = {k: [] for k in args.shards}
    for _ in range(args.repeats):  # interleaved, so drift in the machine's speed is shared
        for k in args.shards:
            runs[k].append(run(k, args.clients, args.params, args.seconds))
            print(k, "shard(s):", round(runs[k][-1]["GB_per_s"], 3), "GB/s", flush=True)
    base = median(r["GB_per_s"] for r in runs[args.shards[0]])
    report("ps_shard_throughput", {
        "parameters": args.params, "clients": args.clients, "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "median_GB_per_s": {k: median(r["GB_per_s"] for r in rs) for k, rs in runs.items()},
        "speedup_vs_first": {k: median(r["GB_per_s"] for r in rs) / base
                             for k, rs in runs.items()},
        "any_lost_or_doubled": any(r["lost_or_doubled"] for rs in runs.values() for r in rs),
        "runs": runs})


if __name__ == "__main__":
    main()
