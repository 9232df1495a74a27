"""The parameter server as a child process of the driver, owned for the length of one fit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from sparkdl_avg._errors import TrainingError
from sparkdl_avg._ps_server import SECRET_ENV

_START_TIMEOUT_S = 60.0


class Sidecar:
    """`python -m sparkdl_avg ps serve` beside the driver. Leaving the block stops it; if the
    driver dies instead, the server's watchdog sees the parent gone and exits."""

    def __init__(self, *, host: str, secret: bytes, settings: dict,
                 staleness_bound: int | None, timeout: float) -> None:
        self._args = [
            "--host", host, "--algorithm", settings["algorithm"], "--lr", str(settings["lr"]),
            "--update-scale", repr(settings["update_scale"]), "--timeout", str(timeout),
            "--parent-pid", str(os.getpid()),
        ]
        if settings.get("dc_lambda") is not None:
            self._args += ["--dc-lambda", str(settings["dc_lambda"])]
        if staleness_bound is not None:
            self._args += ["--staleness-bound", str(staleness_bound)]
        self._secret = secret
        self._proc: subprocess.Popen | None = None
        self._dir: tempfile.TemporaryDirectory | None = None
        self.port = 0

    def __enter__(self) -> Sidecar:
        self._dir = tempfile.TemporaryDirectory(prefix="sparkdl-avg-ps-")
        ready = os.path.join(self._dir.name, "ready.json")
        env = {**os.environ, SECRET_ENV: self._secret.hex()}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sparkdl_avg", "ps", "serve", *self._args,
             "--ready-file", ready], env=env, stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not os.path.exists(ready):
            if self._proc.poll() is not None:
                self.__exit__(None, None, None)
                raise TrainingError(f"the parameter server exited at start "
                                    f"(code {self._proc.returncode})")
            if time.monotonic() > deadline:
                self.__exit__(None, None, None)
                raise TrainingError(f"the parameter server did not start in "
                                    f"{_START_TIMEOUT_S:.0f}s")
            time.sleep(0.05)
        with open(ready) as f:
            self.port = json.load(f)["port"]
        return self

    def __exit__(self, *exc_info) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None
