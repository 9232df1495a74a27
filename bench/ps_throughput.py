"""Parameter server on loopback: (1) push + pull throughput of a 25M-parameter float32 model
with 4 concurrent clients; (2) a soak: 16 clients hammering it, checking that the server's
applied count equals the pushes the clients saw acknowledged. Clients are processes.

    python bench/ps_throughput.py [--seconds 20] [--soak-seconds 60]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import report  # noqa: E402

from sparkdl_avg.ps.client import PSClient  # noqa: E402
from sparkdl_avg.ps.server import DRIVER  # noqa: E402
from sparkdl_avg.ps.settings import ServerSettings  # noqa: E402
from sparkdl_avg.ps.sharded_client import connect  # noqa: E402
from sparkdl_avg.ps.sidecar import Sidecar  # noqa: E402

SECRET = os.urandom(32)


def client_loop(addresses: list[tuple[str, int]], secret: bytes, worker: int, numel: int,
                seconds: float, out) -> None:
    """One client process: push and pull for `seconds`, then put (worker, pushes acked) on
    `out`. `addresses`: the server, or its shards in order."""
    update = np.full(numel, 1e-9, np.float32)
    acks = 0
    with connect(addresses, secret=secret, worker=worker, numel=numel, dtype=np.float32,
                 timeout=60) as c:
        c.pull()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            c.push(update)
            acks += 1
            c.pull()
    out.put((worker, acks))


def run_clients(addresses: list[tuple[str, int]], secret: bytes, clients: int, numel: int,
                seconds: float) -> tuple[dict[int, int], float]:
    """`clients` processes running `client_loop` at once: (pushes acked by worker, wall s)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=client_loop, args=(addresses, secret, w, numel, seconds, out))
             for w in range(clients)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    acks = dict(out.get(timeout=seconds + 300) for _ in procs)
    wall = time.perf_counter() - t0
    for p in procs:
        p.join(30)
    return acks, wall


def run(clients: int, numel: int, seconds: float) -> dict:
    with Sidecar(ServerSettings(timeout=120), host="127.0.0.1", secret=SECRET) as ps, \
            PSClient(("127.0.0.1", ps.port), secret=SECRET, worker=DRIVER, numel=numel,
                     dtype=np.float32, timeout=60) as driver:
        driver.init(np.zeros(numel, np.float32))
        acks, wall = run_clients([("127.0.0.1", ps.port)], SECRET, clients, numel, seconds)
        applied = driver.stats()["applied"]
    pushes = sum(acks.values())
    moved = pushes * numel * 4 * 2  # each acknowledged push was followed by a pull
    return {"clients": clients, "parameters": numel, "seconds": wall, "pushes_acked": pushes,
            "server_applied": applied, "lost_updates": applied - pushes if applied != pushes
            else 0, "GB_per_s": moved / wall / 1e9, "per_client_acks": acks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--soak-seconds", type=float, default=60)
    args = parser.parse_args()
    report("ps_throughput", {
        "throughput_25M_4_clients": run(4, 25_000_000, args.seconds),
        "soak_16_clients": run(16, 1_000_000, args.soak_seconds),
    })


if __name__ == "__main__":
    main()
