"""The driver transport's averaging round with replicas on a GPU against the same round with
replicas on the CPU, for each `delta_compression`, without Spark: a loopback coordinator and
2 workers (threads of one process), each holding a 25M-parameter float32 model (100 MB) as one
flat tensor on its device with a pinned host copy. A round: every replica moves (on its
device), sends its parameters or its compressed delta, and takes the average or the update
back. Timed from the driver (the round, wire included) and, for the GPU, the device-host
copies alone (`FlatBuffer.gather` + `scatter`). Round 0 (cold: first sends, first
allocations) is reported apart from the median of the rest (warm).

    python bench/cuda_exchange.py [--rounds 12] [--numel 25000000]
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _common import median, report  # noqa: E402

from sparkdl_avg import TrainConfig  # noqa: E402
from sparkdl_avg.averaging.coordinator import Coordinator  # noqa: E402
from sparkdl_avg.averaging.driver_channel import DriverChannel  # noqa: E402
from sparkdl_avg.averaging.flat_buffer import FlatBuffer  # noqa: E402
from sparkdl_avg.averaging.global_step import GlobalStep  # noqa: E402
from sparkdl_avg.averaging.transport import RoundReport  # noqa: E402
from sparkdl_avg.net import messages as msg  # noqa: E402
from sparkdl_avg.net.auth import Credential, new_secret  # noqa: E402

WORKERS = 2


def rounds_on(device: str, compression: str, rounds: int, numel: int) -> dict:
    secret = new_secret()
    start = np.random.default_rng(0).standard_normal(numel).astype(np.float32)
    config = TrainConfig(delta_compression=compression)
    copies: list[float] = []
    failures: list[BaseException] = []

    def worker(rank: int, address) -> None:
        try:
            param = torch.zeros(numel, device=device)
            buffer = FlatBuffer([param], torch.float32)
            move = torch.randn(numel, device=device,
                               generator=torch.Generator(device).manual_seed(rank)) * 1e-3
            channel = DriverChannel(address, Credential.of(secret, rank),
                                    connect_timeout=60, reply_timeout=120)
            channel.configure(config, [(numel,)], 0)
            channel.open(msg.WorkerHello(rank=rank, host="bench"))
            channel.receive_start(buffer.array)
            buffer.scatter()
            for r in range(rounds):
                param.data.sub_(move)
                channel.exchange(RoundReport(round=r, samples=10, loss_sum=1.0, compute_s=0.0,
                                             setup_s=0.0, lr=None), buffer)
            if rank == 0 and buffer.host is not buffer.flat:
                for _ in range(5):
                    t0 = time.perf_counter()
                    buffer.gather()
                    buffer.scatter()
                    copies.append(time.perf_counter() - t0)
            channel.done([], np.zeros(0, np.uint8))
            channel.close()
        except BaseException as exc:
            failures.append(exc)

    step = (GlobalStep(numel=numel, dtype=np.float32, compression=compression,
                       warmup_rounds=0, outer=None) if compression != "none" else None)
    times, wire = [], []
    with Coordinator(host="127.0.0.1", advertise="127.0.0.1", num_workers=WORKERS,
                     secret=secret, timeout=120, dtype=np.float32, model_numel=numel,
                     check_job=lambda wait: None, step=step) as coord:
        threads = [threading.Thread(target=worker, args=(rank, coord.address))
                   for rank in range(WORKERS)]
        for t in threads:
            t.start()
        coord.accept_workers(start, deadline_s=120)
        for r in range(rounds):
            t0 = time.perf_counter()
            wire.append(coord.run_round(r, model_numel=numel, allow_state=False,
                                        evaluate=False).wire_bytes)
            times.append(time.perf_counter() - t0)
        coord.finish()
        for t in threads:
            t.join(120)
    if failures:
        raise failures[0]
    return {"cold_round_s": round(times[0], 4), "warm_round_median_s": round(median(times[1:]), 4),
            "wire_mb_per_round": round(median(wire) / 1e6, 2),
            "device_host_copies_median_s": round(median(copies), 4) if copies else None}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--numel", type=int, default=25_000_000)
    args = parser.parse_args()
    devices = ["cuda:0", "cpu"] if torch.cuda.is_available() else ["cpu"]
    result: dict = {"workers": WORKERS, "numel": args.numel, "rounds": args.rounds,
                    "note": "workers are threads of one process on one GPU (or the CPU); "
                            "loopback TCP"}
    for device in devices:
        for compression in ("none", "bf16", "int8", "int4"):
            key = f"{device.split(':')[0]}_{compression}"
            result[key] = rounds_on(device, compression, args.rounds, args.numel)
            print(key, result[key], file=sys.stderr, flush=True)
    for compression in ("none", "bf16", "int8", "int4"):
        if f"cuda_{compression}" in result:
            result[f"gpu_over_cpu_warm_{compression}"] = round(
                result[f"cuda_{compression}"]["warm_round_median_s"]
                / result[f"cpu_{compression}"]["warm_round_median_s"], 3)
    report("cuda_exchange", result)


if __name__ == "__main__":
    main()
