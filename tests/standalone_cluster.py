"""A Spark standalone cluster on loopback: one master and N workers, each worker owning one
fake GPU with its own address (or, with `real_gpu=True`, each reporting the machine's GPU 0),
started with the launcher pip's pyspark ships
(`sbin/spark-daemon.sh`; there is no start-master.sh). Everything it starts is stopped on
leaving, even after a failure.

    python tests/standalone_cluster.py up --dir /tmp/cluster     # prints the master URL
    python tests/standalone_cluster.py down --dir /tmp/cluster
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pyspark

SPARK_HOME = Path(pyspark.__file__).parent
DAEMON = SPARK_HOME / "sbin" / "spark-daemon.sh"
MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StandaloneCluster:
    def __init__(self, folder: str | os.PathLike, *, workers: int = 2, cores: int = 1,
                 memory: str = "2g", real_gpu: bool = False) -> None:
        self.folder = Path(folder)
        self.workers, self.cores, self.memory = workers, cores, memory
        self.real_gpu = real_gpu
        self.port, self.ui_port = _free_port(), _free_port()
        self.url = f"spark://127.0.0.1:{self.port}"

    def _env(self, worker: int | None = None) -> dict:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_LOG_DIR": str(self.folder / "logs"),
               "SPARK_PID_DIR": str(self.folder / "pids"),
               "SPARK_IDENT_STRING": f"sparkdl-avg-{self.port}",
               "SPARK_WORKER_DIR": str(self.folder / "work"),
               "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable)}
        if not self.real_gpu:
            # the GPUs are fake: on a machine with real ones, CUDA must not see them, or
            # a fake address (worker 1's "1" on a one-GPU machine) meets a real device
            env["CUDA_VISIBLE_DEVICES"] = ""
        if worker is not None:
            address = 0 if self.real_gpu else worker
            script = self.folder / f"gpu-{worker}.sh"
            script.write_text(f'#!/bin/sh\necho \'{{"name": "gpu", "addresses": '
                              f'["{address}"]}}\'\n')
            script.chmod(0o755)
            env["SPARK_WORKER_OPTS"] = (
                "-Dspark.worker.resource.gpu.amount=1 "
                f"-Dspark.worker.resource.gpu.discoveryScript={script}")
        return env

    def _daemon(self, action: str, cls: str, instance: int, *args: str, env: dict) -> None:
        subprocess.run(["bash", str(DAEMON), action, cls, str(instance), *args], env=env,
                       check=action == "start", capture_output=True, timeout=60)

    def start(self, timeout: float = 120.0) -> StandaloneCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "state.json").write_text(json.dumps(
            {"port": self.port, "ui_port": self.ui_port, "workers": self.workers}))
        try:
            self._daemon("start", MASTER_CLASS, 1, "--host", "127.0.0.1", "--port",
                         str(self.port), "--webui-port", str(self.ui_port), env=self._env())
            for w in range(self.workers):
                self._daemon("start", WORKER_CLASS, w + 1, self.url, "--host", "127.0.0.1",
                             "--cores", str(self.cores), "--memory", self.memory,
                             "--webui-port", "0", env=self._env(w))
            self._wait_for_workers(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_for_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/",
                                            timeout=2) as r:
                    state = json.load(r)
                if state.get("aliveworkers", 0) >= self.workers:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-1500:] for p in
                                 sorted((self.folder / "logs").glob("*.out")))
                raise TimeoutError(f"{self.workers} workers did not register in {timeout}s\n"
                                   f"{logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        """Stop the workers and the master through spark-daemon.sh (`stop_daemons`)."""
        def stop_all() -> None:
            for cls, instance in [*((WORKER_CLASS, w + 1) for w in range(self.workers)),
                                  (MASTER_CLASS, 1)]:
                with contextlib.suppress(subprocess.SubprocessError, OSError):
                    self._daemon("stop", cls, instance, env=self._env())

        stop_daemons(self.folder / "pids", stop_all, b"org.apache.spark.deploy")

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def stop_daemons(pid_folder: Path, stop, marker: bytes) -> None:
    """Read the pid files Spark's daemon scripts wrote, call `stop()` (the scripts' own stop),
    then SIGKILL any of those processes (whose command line holds `marker`) still alive 10 s
    later."""
    pids = []
    for pid_file in pid_folder.glob("*.pid"):
        with contextlib.suppress(OSError, ValueError):
            pids.append(int(pid_file.read_text().strip()))
    stop()
    deadline = time.monotonic() + 10
    for pid in pids:
        while _alive(pid, marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid, marker):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", required=True)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    cluster = StandaloneCluster(args.dir, workers=args.workers)
    if args.action == "up":
        print(cluster.start().url)
    else:
        state = json.loads((Path(args.dir) / "state.json").read_text())
        cluster.port, cluster.workers = state["port"], state["workers"]
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
