"""A Spark Connect server on loopback, master local[2], for the Connect tests: what
`sbin/start-connect-server.sh` runs, called as `sbin/spark-daemon.sh` directly, which pip's
pyspark carries on every 4.x line (4.0's wheel lacks the start and stop scripts). Its Python
workers import the tests' helper modules (PYTHONPATH). Stopped on leaving, even after a failure.

    python tests/connect_server.py up --dir /tmp/connect     # prints the sc:// URL
    python tests/connect_server.py down --dir /tmp/connect
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pyspark
from standalone_cluster import stop_daemons

from sparkdl_avg import SPARK_CONF

SPARK_HOME = Path(pyspark.__file__).parent
SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
TESTS = Path(__file__).parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ConnectServer:
    def __init__(self, folder: str | os.PathLike, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.port = port or _free_port()
        self.url = f"sc://127.0.0.1:{self.port}"

    def _env(self) -> dict:
        path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1",
                "SPARK_LOG_DIR": str(self.folder / "logs"),
                "SPARK_PID_DIR": str(self.folder / "pids"),
                "SPARK_IDENT_STRING": f"sparkdl-avg-connect-{self.port}",
                "PYSPARK_PYTHON": os.environ.get("PYSPARK_PYTHON", sys.executable),
                "PYTHONPATH": path}

    def start(self, timeout: float = 120.0) -> ConnectServer:
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "state.json").write_text(json.dumps({"port": self.port}))
        try:
            subprocess.run(
                ["bash", str(SPARK_HOME / "sbin" / "spark-daemon.sh"), "submit", SERVER_CLASS,
                 "1", "--name", "Spark Connect server",
                 "--master", "local[2]", "--driver-memory", "2g",
                 "--conf", "spark.connect.grpc.binding.address=127.0.0.1",
                 "--conf", f"spark.connect.grpc.binding.port={self.port}",
                 "--conf", "spark.driver.host=127.0.0.1",
                 "--conf", "spark.ui.enabled=false",
                 "--conf", "spark.sql.shuffle.partitions=4",
                 *[arg for key, value in SPARK_CONF.items()
                   for arg in ("--conf", f"{key}={value}")]],
                env=self._env(), check=True, capture_output=True, timeout=60)
            self._wait(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=1):
                return
            if time.monotonic() > deadline:
                logs = "\n".join(p.read_text()[-3000:]
                                 for p in sorted((self.folder / "logs").glob("*.out")))
                raise TimeoutError(f"the Connect server did not listen in {timeout}s\n{logs}")
            time.sleep(0.5)

    def stop(self) -> None:
        """What stop-connect-server.sh runs, then SIGKILL if the server is still alive 10 s
        later."""
        def stop_script() -> None:
            with contextlib.suppress(subprocess.SubprocessError, OSError):
                subprocess.run(["bash", str(SPARK_HOME / "sbin" / "spark-daemon.sh"), "stop",
                                SERVER_CLASS, "1"],
                               env=self._env(), capture_output=True, timeout=60)

        stop_daemons(self.folder / "pids", stop_script, b"SparkConnectServer")

    def __enter__(self) -> ConnectServer:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--dir", required=True)
    args = parser.parse_args(argv)
    if args.action == "up":
        print(ConnectServer(args.dir).start().url)
    else:
        state = json.loads((Path(args.dir) / "state.json").read_text())
        ConnectServer(args.dir, port=state["port"]).stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
